"""What the ranks of a restore share over the process group instead of each reading it from
storage: the manifest (rank 0 read it while listing) and the boxes several ranks need
(:mod:`spotrun.checkpoint.share_plan` says who reads which; the readers verify every block
before anything is sent).

The transport is :class:`Peers`: a bounded gloo group of every rank
(:class:`~spotrun.tools.collectives.BoundedGroup`: CPU tensors, whatever backend the training
uses), every wait bounded by the restore's timeout. A rank that does not arrive or answer in
time is named (:class:`~spotrun.errors.CollectiveTimeoutError`) and the group is not used again.

The bytes of a group travel in rounds: in round ``k`` each reader sends the ``k``-th piece of
its stream (the boxes it read for the group, in plan order, back to back) to every other member,
and receives theirs. A piece that lies within one box goes straight from the reader's tensor
into the receiver's (no copy, no extra memory); pieces that span boxes (small tensors) are packed
into one buffer. Pieces are sized so a round holds at most :data:`ROUND_BYTES` per rank. Details
and what it costs: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.share_plan import Need, ShareGroup
from spotrun.checkpoint.stream import byte_view, copy_bytes
from spotrun.errors import SpotrunError
from spotrun.storage.base import Storage
from spotrun.tools import collectives, dist
from spotrun.tools.collectives import BoundedGroup

#: The slowest link between ranks a round of transfers is given time for, past the restore's bound.
PEER_MIN_BYTES_PER_S = 25 * 2**20
#: Bytes a rank receives in one round at most (unless pieces of MIN_PIECE_BYTES in a group of
#: more than ROUND_BYTES / MIN_PIECE_BYTES + 1 ranks make more); the scratch for packed pieces
#: is within this. A state takes about its bytes / ROUND_BYTES rounds whatever the group's size.
ROUND_BYTES = 256 * 2**20
MIN_PIECE_BYTES = 64 * 2**10
MAX_PIECE_BYTES = 64 * 2**20


class HeldBack(SpotrunError):
    """Another rank could not load the step, so this one stops loading it too (its own
    problem, if any, is the other rank's to report)."""


class Peers:
    """Every rank of a restore, for its collectives and transfers (see the module docstring).

    Args:
        group: a bounded group of every rank (:mod:`spotrun.tools.collectives`), global ranks
            equal to group ranks.
        timeout_s: the bound of every wait (a round of transfers: plus its bytes at
            :data:`PEER_MIN_BYTES_PER_S`).
        what: what the ranks restore, as the errors say it (``"step 10's restore"``).
    """

    def __init__(self, group: BoundedGroup, timeout_s: float, what: str) -> None:
        self.group: BoundedGroup | None = group
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.timeout_s = timeout_s
        self.what = what
        self._owned = False
        self._transfers: int | None = None

    @classmethod
    def open(cls, *, timeout_s: float, what: str) -> Peers | None:
        """A new bounded group of every rank (collective: every rank calls it, in the same
        order); ``None`` without peers (no process group, or one rank)."""
        if not dist.is_distributed() or dist.world_size() < 2:
            return None
        peers = cls(collectives.new_group("restore", timeout_s=timeout_s, what=what), timeout_s, what)
        peers._owned = True
        return peers

    def close(self) -> None:
        """Free the group when :meth:`open` made it (a group that failed is left alone)."""
        if self._owned and self.group is not None:
            self.group.destroy()
        self.group = None

    def gather_json(self, value: Any, phase: str) -> list[Any]:
        """Every rank's JSON ``value``, by rank; ``phase`` names the gather (``"the plan"``)."""
        return dist.all_gather_json(value, group=self.group, timeout_s=self.timeout_s, what=self._what(phase))

    def broadcast_bytes(self, data: bytes | None, phase: str) -> bytes | None:
        """Rank 0's ``data`` on every rank (``None`` travels as such)."""
        # a value travels behind a marker byte, so that None (nothing at all) differs from b""
        mine = (b"" if data is None else b"\x01" + data) if self.rank == 0 else None
        assert self.group is not None
        text = self.group.broadcast_bytes(mine, 0, timeout_s=self.timeout_s, what=self._what(phase))
        return text[1:] if text else None

    def begin_transfers(self) -> None:
        """Start the transfers of this step (every rank at the same point: :func:`share`)."""
        assert self.group is not None
        self._transfers = self.group.begin_transfers(self._what("the transfers"))

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Send each ``(peer, tag, tensor)`` of ``sends`` and receive each of ``recvs`` (contiguous
        CPU tensors), all at once; returns when every one is done.

        Raises:
            CollectiveTimeoutError: they took longer than the timeout plus their bytes at
                :data:`PEER_MIN_BYTES_PER_S`, or a peer's connection closed; it names the peers
                that did not answer.
        """
        assert self.group is not None and self._transfers is not None, "begin_transfers() first"
        nbytes = sum(t.numel() for _, _, t in sends) + sum(t.numel() for _, _, t in recvs)
        self.group.transfer(
            sends,
            recvs,
            phase=self._transfers,
            timeout_s=self.timeout_s + nbytes / PEER_MIN_BYTES_PER_S,
            what=self._what("the transfers"),
        )

    def _what(self, phase: str) -> str:
        return f"{phase} of {self.what}"


def piece_bytes(group_size: int) -> int:
    """The bytes of one piece of a stream in a group of ``group_size`` ranks."""
    return max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, ROUND_BYTES // max(1, group_size - 1)))


class _Stream:
    """The boxes a reader sends for a group, back to back: each box's bytes on this rank (what
    it read, or where it receives)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views
        self.starts = [0]
        for view in views:
            self.starts.append(self.starts[-1] + view.numel())
        self.nbytes = self.starts[-1]

    def parts(self, begin: int, end: int) -> list[torch.Tensor]:
        """The views of bytes ``[begin, end)`` of the stream, in order."""
        found = []
        i = bisect.bisect_right(self.starts, begin) - 1
        while 0 <= i < len(self.views) and self.starts[i] < end:
            start, stop = self.starts[i], self.starts[i + 1]
            if stop > begin:
                found.append(self.views[i][max(begin, start) - start : min(end, stop) - start])
            i += 1
        return found


def share(peers: Peers, groups: list[ShareGroup], tensors: Mapping[Need, torch.Tensor]) -> int:
    """Send this rank's reads to the other members of each of its ``groups`` and receive theirs
    into ``tensors`` (need -> contiguous CPU tensor of the need's bytes, on every member); the
    bytes received.

    Every member handles its groups in the same order (the plan's), round by round, so each
    transfer has its counterpart; tags count the messages between each pair of ranks.

    Raises:
        CollectiveTimeoutError: a transfer failed or timed out (it names the ranks that did not answer).
    """
    me = peers.rank
    peers.begin_transfers()
    sent_to: dict[int, int] = defaultdict(int)  # peer -> messages so far (the next tag)
    received_from: dict[int, int] = defaultdict(int)
    received = 0
    for group in groups:
        streams = {r: _Stream([byte_view(tensors[n]) for n in group.stream(r)]) for r in group.ranks}
        piece = piece_bytes(len(group.ranks))
        others = [r for r in group.ranks if r != me]
        rounds = max(math.ceil(s.nbytes / piece) for s in streams.values())
        for k in range(rounds):
            sends, recvs, unpack = [], [], []
            outgoing = _piece(streams[me], k, piece)
            if outgoing is not None:
                for peer in others:
                    sends.append((peer, sent_to[peer], outgoing))
                    sent_to[peer] += 1
            for peer in others:
                parts = streams[peer].parts(k * piece, (k + 1) * piece)
                if not parts:
                    continue
                into = parts[0] if len(parts) == 1 else torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8)
                recvs.append((peer, received_from[peer], into))
                received_from[peer] += 1
                received += into.numel()
                if len(parts) > 1:
                    unpack.append((into, parts))
            peers.exchange(sends, recvs)
            for into, parts in unpack:
                offset = 0
                for part in parts:
                    copy_bytes(part, into[offset : offset + part.numel()])
                    offset += part.numel()
    return received


def _piece(stream: _Stream, k: int, piece: int) -> torch.Tensor | None:
    """The ``k``-th piece of ``stream`` to send: a view where it lies within one box, else packed."""
    parts = stream.parts(k * piece, (k + 1) * piece)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def relay_manifest(peers: Peers, storage: Storage, key: str, listed: tuple[Manifest, bytes | None] | None) -> Manifest:
    """The step's manifest on every rank, read once: rank 0 sends the bytes it parsed while
    listing (or reads them), and every other rank parses them with the same strict parser.

    Raises:
        HeldBack: rank 0 could not read or parse it (rank 0 raises its own error).
        ManifestError, StorageError: as reading and parsing raise them.
    """
    where = f"{storage.uri}/{key}"
    if peers.rank == 0:
        try:
            manifest, text = listed if listed is not None and listed[1] is not None else (None, storage.get(key))
            if manifest is None:
                manifest = Manifest.from_json(text, where=where)
        except Exception:
            peers.broadcast_bytes(None, "the manifest")  # the others learn that rank 0 stops
            raise
        peers.broadcast_bytes(text, "the manifest")
        return manifest
    text = peers.broadcast_bytes(None, "the manifest")
    if text is None:
        raise HeldBack(f"rank 0 could not read {where}")
    return Manifest.from_json(text, where=where)
