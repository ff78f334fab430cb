"""Thin helpers over ``torch.distributed`` that also work in a single process.

When no process group is initialised every helper behaves as world size 1, so the
library runs unchanged in a plain ``python train.py``. The collectives run on spotrun's own
gloo groups (CPU, no device sync), each bounded by its caller's ``timeout_s``: a rank that does
not arrive is named (:mod:`spotrun.tools.collectives`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from spotrun.tools import collectives
from spotrun.tools.collectives import BoundedGroup, Pending


def is_distributed() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Rank within this node, from torchrun's ``LOCAL_RANK`` (falls back to the global rank)."""
    raw = os.environ.get("LOCAL_RANK")
    return int(raw) if raw and raw.isdigit() else rank()


def any_rank(flag: bool, *, timeout_s: float, what: str) -> bool:
    """True on every rank if ``flag`` is true on at least one (one all-reduce on spotrun's training
    group, bounded by ``timeout_s``; ``what`` names it in the error: see :func:`all_gather_json`)."""
    return any_rank_each([flag], timeout_s=timeout_s, what=what)[0]


def any_rank_each(flags: list[bool], *, timeout_s: float, what: str) -> list[bool]:
    """Element-wise :func:`any_rank` of several flags in one all-reduce."""
    return start_any_rank_each(flags, timeout_s=timeout_s, what=what).wait()


def start_any_rank_each(flags: list[bool], *, timeout_s: float, what: str) -> Pending[list[bool]] | Done:
    """Start :func:`any_rank_each`; its ``wait()`` gives the flags (the bound counts from the start)."""
    if not is_distributed():
        return Done(list(flags))
    group = collectives.training_group(timeout_s=timeout_s, what=what)
    pending = group.start_all_reduce_max([1 if f else 0 for f in flags], timeout_s=timeout_s, what=what)
    return _Flags(pending)


def all_gather_json(value: Any, *, timeout_s: float, what: str, group: BoundedGroup | None = None) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, indexed by rank.

    Values travel as JSON text, never pickled. ``group``: a background thread's own group
    (:func:`new_background_group`), so its collectives never interleave with the training
    thread's; default: the training thread's group (:func:`spotrun.tools.collectives.training_group`).
    Never on the job's default group.

    Raises:
        CollectiveTimeoutError: not every rank arrived within ``timeout_s`` seconds (the message
            names the ranks that did not, and ``what``: ``"the write gather of step 40's save"``).
    """
    if not is_distributed():
        return [value]  # nothing travels
    text = json.dumps(value, allow_nan=False).encode()
    group = group or collectives.training_group(timeout_s=timeout_s, what=what)
    return [json.loads(t) for t in group.all_gather_bytes(text, timeout_s=timeout_s, what=what)]


def broadcast_json(value: Any, src: int = 0, *, timeout_s: float, what: str, group: BoundedGroup | None = None) -> Any:
    """Rank ``src``'s (global rank) JSON-serialisable ``value`` on every rank; as :func:`all_gather_json`."""
    if not is_distributed():
        return value  # nothing travels
    text = json.dumps(value, allow_nan=False).encode() if rank() == src else None
    group = group or collectives.training_group(timeout_s=timeout_s, what=what)
    return json.loads(group.broadcast_bytes(text, src, timeout_s=timeout_s, what=what))


def new_background_group(*, timeout_s: float, what: str) -> BoundedGroup | None:
    """A bounded gloo group over all ranks for a background thread's collectives (collective:
    every rank must call it, in the same order); ``None`` without a process group.

    Collectives of one group must be issued in the same order on every rank; a thread that
    shares the training thread's group could interleave with its all-reduces. gloo runs on
    CPU whatever the training backend, so JSON collectives need no device.
    """
    if not is_distributed():
        return None
    return collectives.new_group("background", timeout_s=timeout_s, what=what)


class Done:
    """A result known at once (no process group): ``wait()`` returns it."""

    def __init__(self, value: list[bool]) -> None:
        self._value = value

    def wait(self) -> list[bool]:
        return self._value


class _Flags:
    def __init__(self, pending: Pending[list[int]]) -> None:
        self._pending = pending

    def wait(self) -> list[bool]:
        return [bool(v) for v in self._pending.wait()]
