"""What the ranks of a restore share over the process group instead of each reading it from
storage: the manifest (rank 0 read it while listing) and the boxes several ranks need
(:mod:`spotrun.checkpoint.share_plan` says who reads which; the readers verify every block
before anything is sent).

The transport is :class:`Peers`: a gloo group of every rank (CPU tensors, whatever backend the
training uses), every wait bounded. It is the one seam to the process group: whoever owns a
gloo group of every rank may pass it in. After a wait times out the group is not used again
(gloo closes the pairs): :class:`PeerError` is raised and the group is closed.

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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.share_plan import Need, ShareGroup
from spotrun.checkpoint.stream import byte_view, copy_bytes
from spotrun.errors import SpotrunError
from spotrun.storage.base import Storage
from spotrun.tools import dist

#: How long a rank waits for the others at each step of a cooperative restore (a collective or
#: a round of transfers), before the bytes of the round are counted at PEER_MIN_BYTES_PER_S.
PEER_TIMEOUT_S = 300.0
#: The slowest link between ranks a round of transfers is given time for.
PEER_MIN_BYTES_PER_S = 25 * 2**20
#: Bytes a rank receives in one round at most (unless pieces of MIN_PIECE_BYTES in a group of
#: more than ROUND_BYTES / MIN_PIECE_BYTES + 1 ranks make more); the scratch for packed pieces
#: is within this. A state takes about its bytes / ROUND_BYTES rounds whatever the group's size.
ROUND_BYTES = 256 * 2**20
MIN_PIECE_BYTES = 64 * 2**10
MAX_PIECE_BYTES = 64 * 2**20


class PeerError(SpotrunError):
    """A transfer between the ranks of a restore failed or timed out (the group is closed)."""


class HeldBack(SpotrunError):
    """Another rank could not load the step, so this one stops loading it too (its own
    problem, if any, is the other rank's to report)."""


class Peers:
    """A gloo group of every rank, for the transfers of a restore (see the module docstring).

    Args:
        group: a gloo process group of every rank, global ranks equal to group ranks.
        timeout_s: the bound of every wait (:data:`PEER_TIMEOUT_S`).
    """

    def __init__(self, group: Any, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.group = group
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.timeout_s = timeout_s
        self._owned = False

    @classmethod
    def open(cls, timeout_s: float = PEER_TIMEOUT_S) -> Peers | None:
        """A new gloo group of every rank (collective: every rank calls it, in the same order);
        ``None`` without peers (no process group, or one rank)."""
        if not dist.is_distributed() or dist.world_size() < 2:
            return None
        peers = cls(torch_dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)), timeout_s)
        peers._owned = True
        return peers

    def close(self) -> None:
        """Free the group when :meth:`open` made it."""
        if self._owned and self.group is not None:
            torch_dist.destroy_process_group(self.group)
        self.group = None

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON ``value``, by rank (bounded by the group's timeout)."""
        try:
            return dist.all_gather_json(value, group=self.group)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: gathering from the other ranks failed: {exc}") from exc

    def broadcast_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0's ``data`` on every rank (``None`` travels as such)."""
        size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
        self._broadcast(size)
        if size.item() < 0:
            return None
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data else None
        if body is None:
            body = torch.empty(int(size.item()), dtype=torch.uint8)
        if body.numel():
            self._broadcast(body)
        return body.numpy().tobytes()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = torch_dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self._timeout(tensor.numel())
        try:
            self.group.broadcast([tensor], opts).wait()
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: broadcast from rank 0 failed: {exc}") from exc

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Send each ``(peer, tag, tensor)`` of ``sends`` and receive each of ``recvs`` (contiguous
        CPU tensors), all at once; returns when every one is done.

        Raises:
            PeerError: one failed, or they took longer than the timeout plus their bytes at
                :data:`PEER_MIN_BYTES_PER_S`.
        """
        nbytes = sum(t.numel() for _, _, t in sends) + sum(t.numel() for _, _, t in recvs)
        try:
            works = [torch_dist.isend(t, peer, group=self.group, tag=tag) for peer, tag, t in sends]
            works += [torch_dist.irecv(t, peer, group=self.group, tag=tag) for peer, tag, t in recvs]
            timeout = self._timeout(nbytes)
            for work in works:
                work.wait(timeout)
        except RuntimeError as exc:
            peers = sorted({peer for peer, _, _ in sends + recvs})
            raise PeerError(f"rank {self.rank}: a transfer with rank(s) {peers} failed: {exc}") from exc

    def _timeout(self, nbytes: int) -> timedelta:
        return timedelta(seconds=self.timeout_s + nbytes / PEER_MIN_BYTES_PER_S)


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
        PeerError: a transfer failed or timed out.
    """
    me = peers.rank
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
            peers.broadcast_bytes(None)  # the others learn that rank 0 stops
            raise
        peers.broadcast_bytes(text)
        return manifest
    text = peers.broadcast_bytes(None)
    if text is None:
        raise HeldBack(f"rank 0 could not read {where}")
    return Manifest.from_json(text, where=where)
