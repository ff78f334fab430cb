"""What one node's fast tier holds: its own ranks' files in ``steps/`` (with the step's manifest)
and the replicas of other nodes' files in ``replicas/<node>/``, seen as one set of keys.

Every copy of a key is the same bytes (a file's name carries its rank and incarnation), so a key
is read from whichever copy is there, and deleting a key deletes every copy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from spotrun.errors import ConfigError, ObjectNotFoundError
from spotrun.storage.base import ObjectInfo
from spotrun.storage.local import LocalStorage
from spotrun.storage.tier_dir import STEPS_DIR

#: Under a tier directory: one directory per node whose files this node holds a replica of.
REPLICAS_DIR = "replicas"
#: What a node's name may be (a tier directory's name): it becomes a directory name here.
_NODE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")


def check_node(node: str) -> str:
    """``node`` when it is a valid node name, else :class:`ConfigError` (it is a peer's input)."""
    if not isinstance(node, str) or not _NODE_RE.match(node):
        raise ConfigError(f"not a node name: {node!r}")
    return node


class NodeHoldings:
    """The keys one tier directory holds, own and replicated."""

    def __init__(self, tier_path: str) -> None:
        self.tier_path = tier_path
        self.own = LocalStorage(os.path.join(tier_path, STEPS_DIR), fsync=False, direct_io=False)
        self._replicas_path = os.path.join(tier_path, REPLICAS_DIR)

    def replica_root(self, node: str) -> LocalStorage:
        """Where this node keeps ``node``'s replicated files (made on first use)."""
        path = os.path.join(self._replicas_path, check_node(node))
        os.makedirs(path, mode=0o700, exist_ok=True)
        return LocalStorage(path, fsync=False, direct_io=False)

    def replica_nodes(self) -> list[str]:
        """The nodes this node holds replicas of."""
        try:
            return sorted(n for n in os.listdir(self._replicas_path) if _NODE_RE.match(n))
        except FileNotFoundError:
            return []

    def roots(self) -> list[LocalStorage]:
        """Own files first, then each replica's."""
        return [self.own] + [
            LocalStorage(os.path.join(self._replicas_path, n), fsync=False, direct_io=False)
            for n in self.replica_nodes()
        ]

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every key held here under ``prefix``, once."""
        found: dict[str, ObjectInfo] = {}
        for root in self.roots():
            for info in root.list(prefix):
                if info.refused is None:
                    found.setdefault(info.key, info)
        return [found[k] for k in sorted(found)]

    def holder(self, key: str) -> LocalStorage | None:
        """A root holding ``key``, or ``None``."""
        for root in self.roots():
            if root.exists(key):
                return root
        return None

    def stat(self, key: str) -> ObjectInfo:
        root = self.holder(key)
        if root is None:
            raise ObjectNotFoundError(2, f"{key} is not held in the fast tier {self.tier_path}")
        return root.stat(key)

    def read_into(self, key: str, offset: int, views: Sequence[memoryview]) -> None:
        root = self.holder(key)
        if root is None:
            raise ObjectNotFoundError(2, f"{key} is not held in the fast tier {self.tier_path}")
        root.read_into(key, offset, views)

    def delete(self, key: str) -> None:
        """Delete every copy of ``key`` held here."""
        for root in self.roots():
            root.delete(key)
