"""Which rank reads which bytes at a restore, when ranks need the same bytes (a cooperative
restore: :mod:`spotrun.checkpoint.cooperative` moves them).

A rank's *needs* are the boxes of the tensors it restores (:class:`Need`: a tensor of the
manifest, offsets and lengths in its global shape). Ranks that need the same box of the same
tensor (the replicated state of DDP ranks; the boxes of an HSDP replica group) read it from
storage once per group; the reader sends it to the others. Everything here is a pure function of
the needs of every rank and the manifest (no tensors, no communication): every rank computes the
same plan, and the scale model (``benchmarks/``) runs the product's own planning.

A rank's needs are cut into *segments* (by the first component of the tensor's name, and whole
tensors apart from boxes of them), each named by a digest of its needs; ranks holding the same
digest form a group. So the ranks exchange one digest per segment, never their needs, and a
rank alone with a segment reads it as it would without peers. A group shares its needs in
pieces (:func:`pieces_of`), each read by a rank that wrote it where the balance allows
(:func:`assign_readers`). The rules: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from spotrun.checkpoint.chunks import byte_runs, overlap
from spotrun.checkpoint.manifest import Manifest


@dataclass(frozen=True, order=True)
class Need:
    """A box of one tensor that a rank restores: ``name`` (as the manifest lists it, aliases
    resolved), ``offsets`` and ``lengths`` in its global shape, and its ``nbytes`` (the box's
    elements times the recorded dtype's size)."""

    name: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.lengths


@dataclass(frozen=True)
class ShareGroup:
    """Ranks that hold the same segments, and who reads each of their needs.

    Attributes:
        ranks: the ranks, ascending (two or more).
        needs: every need of the group, sorted: the order the bytes travel in.
        readers: the rank that reads each need from storage (parallel to ``needs``).
    """

    ranks: tuple[int, ...]
    needs: tuple[Need, ...]
    readers: tuple[int, ...]

    def stream(self, reader: int) -> list[Need]:
        """The needs ``reader`` reads for the group, in the order it sends them."""
        return [need for need, r in zip(self.needs, self.readers) if r == reader]


@dataclass(frozen=True)
class ReadPlan:
    """Who reads what (:func:`plan_reads`).

    Attributes:
        groups: the groups of two or more ranks.
        alone: rank -> the needs that no other rank has (read by it for itself).
    """

    groups: list[ShareGroup]
    alone: dict[int, list[Need]]

    def groups_of(self, rank: int) -> list[ShareGroup]:
        """The groups ``rank`` is in, in the order every rank handles them."""
        return [g for g in self.groups if rank in g.ranks]

    def reads(self, rank: int) -> list[Need]:
        """Everything ``rank`` reads from storage."""
        return self.alone.get(rank, []) + [n for g in self.groups_of(rank) for n in g.stream(rank)]

    def bytes_read(self, rank: int) -> int:
        """The bytes of the boxes ``rank`` reads (before rounding out to checksum blocks)."""
        return sum(n.nbytes for n in self.reads(rank))

    def bytes_received(self, rank: int) -> int:
        """The bytes ``rank`` receives from the other ranks of its groups."""
        return sum(n.nbytes for g in self.groups_of(rank) for n, r in zip(g.needs, g.readers) if r != rank)


def segments(needs: Iterable[Need], manifest: Manifest) -> dict[str, tuple[Need, ...]]:
    """One rank's needs by segment: digest -> the segment's needs, sorted (see the module docstring)."""
    by_key: dict[tuple[str, bool], list[Need]] = defaultdict(list)
    for need in needs:
        whole = list(need.lengths) == manifest.tensors[need.name].shape
        by_key[(need.name.partition("/")[0], whole)].append(need)
    return {_digest(found): found for found in (tuple(sorted(v, key=_order)) for v in by_key.values())}


def _order(need: Need) -> tuple:
    """A need's sort key (the dataclass order, computed once per need instead of per comparison)."""
    return need.name, need.offsets, need.lengths, need.nbytes


def _digest(needs: tuple[Need, ...]) -> str:
    text = json.dumps([[n.name, n.offsets, n.lengths, n.nbytes] for n in needs], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def shared_anywhere(digests_by_rank: Sequence[Iterable[str]]) -> bool:
    """Whether any two ranks hold the same segment (then they read cooperatively)."""
    seen: set[str] = set()
    for digests in digests_by_rank:
        mine = set(digests)
        if seen & mine:
            return True
        seen |= mine
    return False


def plan_reads(needs_by_rank: Sequence[Iterable[Need]], manifest: Manifest) -> ReadPlan:
    """Who reads what, from the needs of every rank (indexed by rank) and the step's manifest."""
    cache: dict[int, dict[str, tuple[Need, ...]]] = {}  # ranks given the same list (a simulation) cut it once
    found = []
    for needs in needs_by_rank:
        if id(needs) not in cache:
            cache[id(needs)] = segments(needs, manifest)
        found.append(cache[id(needs)])
    known = {digest: needs for mine in found for digest, needs in mine.items()}
    return plan_from_digests([list(mine) for mine in found], known, manifest)


def plan_from_digests(
    digests_by_rank: Sequence[Iterable[str]], known: Mapping[str, Sequence[Need]], manifest: Manifest
) -> ReadPlan:
    """:func:`plan_reads` from the segment digests of every rank and the segments the caller
    knows (a rank at restore: its own), which is all a rank needs to find the groups it is in.
    Groups made of segments the caller does not know are left out of the plan."""
    holders: dict[str, list[int]] = defaultdict(list)
    for rank, digests in enumerate(digests_by_rank):
        for digest in dict.fromkeys(digests):
            holders[digest].append(rank)
    by_ranks: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for digest, ranks in holders.items():
        by_ranks[tuple(ranks)].append(digest)
    groups, alone = [], {}
    for ranks, digests in sorted(by_ranks.items()):
        if any(d not in known for d in digests):
            continue
        needs = sorted((n for d in digests for n in known[d] if n.nbytes), key=_order)
        if len(ranks) == 1:
            alone[ranks[0]] = needs
        elif needs:
            parts = sorted((part for need in needs for part, _offset in pieces_of(need, manifest)), key=_order)
            groups.append(ShareGroup(ranks, tuple(parts), assign_readers(parts, ranks, manifest)))
    return ReadPlan(groups, alone)


def pieces_of(need: Need, manifest: Manifest) -> list[tuple[Need, int]]:
    """``need`` cut by the chunks that hold it, each piece with its byte offset in the need's box,
    when every piece is one contiguous range of the box's bytes (a box of whole rows cut by
    chunks of rows, as FSDP writes them); else ``need`` itself, at 0. A group shares pieces, so
    that each piece is read by a rank that wrote it (or one rank per writer's file): readers of
    one tensor's pieces then read disjoint files, not the same checksum blocks."""
    record = manifest.tensors[need.name]
    if record.chunks is None or not need.lengths or not need.nbytes:
        return [(need, 0)]
    found = record.chunks.overlapping(need.box)
    if len(found) < 2:
        return [(need, 0)]
    itemsize = need.nbytes // math.prod(need.lengths)
    pieces = []
    for chunk in found:
        common = overlap((chunk.offsets, chunk.lengths), need.box)
        assert common is not None
        in_box = (tuple(o - b for o, b in zip(common[0], need.offsets)), common[1])
        run, starts = byte_runs(need.lengths, in_box, itemsize)
        if len(starts) != 1:
            return [(need, 0)]
        pieces.append((Need(need.name, common[0], common[1], run), starts[0]))
    return pieces


def writers_of(need: Need, manifest: Manifest) -> list[int]:
    """The ranks that wrote the chunks holding ``need``'s box, ascending."""
    chunks = manifest.tensors[need.name].chunks
    if chunks is None:  # formats 1-3: whole files, no chunks
        return []
    whole = chunks.whole_writer
    if whole is not None and list(need.lengths) == list(chunks.shape):
        return [whole]
    return sorted({c.writer for c in chunks.overlapping(need.box)})


def assign_readers(needs: Sequence[Need], ranks: Sequence[int], manifest: Manifest) -> tuple[int, ...]:
    """The reader of each need among ``ranks``: balanced by bytes, each to a rank that wrote it
    where that keeps the balance.

    Largest needs first (ties by name, as the save assigns replicated tensors:
    :func:`spotrun.checkpoint.plan.assign_by_bytes`), each to the least loaded of its *preferred*
    ranks unless that rank would then read more than ``total / len(ranks)`` plus the largest
    need and more than it wrote of them itself, else to the least loaded rank (ties to the
    lowest). A need's preferred ranks are its writers among ``ranks``, and for a writer not among
    them ``ranks[writer % len(ranks)]`` (so one rank reads each such writer's file). At the world
    size that saved, a DDP rank so reads exactly what it wrote (the save packs small tensors into
    bundles, so a writer may hold more than this bound: :mod:`spotrun.checkpoint.plan`) and only
    its own index.
    """
    if not needs:
        return ()
    members = set(ranks)
    ordered = sorted(ranks)
    count = len(ranks)
    total = sum(n.nbytes for n in needs)
    bound = total + max(n.nbytes for n in needs) * count  # a load times count must stay at or under it
    load = dict.fromkeys(ranks, 0)
    wrote = dict.fromkeys(ranks, 0)  # bytes of these needs each rank wrote itself
    for need in needs:
        for writer in writers_of(need, manifest):
            if writer in members:
                wrote[writer] += need.nbytes
    heap = [(0, r) for r in ordered]  # (load, rank); entries go stale as loads grow
    readers: list[int] = [0] * len(needs)
    for i in sorted(range(len(needs)), key=lambda i: (-needs[i].nbytes, _order(needs[i]))):
        need = needs[i]
        preferred = {w if w in members else ordered[w % count] for w in writers_of(need, manifest)}
        reader = min(preferred, key=lambda r: (load[r], r)) if preferred else None
        if reader is None or (
            (load[reader] + need.nbytes) * count > bound and load[reader] + need.nbytes > wrote[reader]
        ):
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            reader = heap[0][1]
        readers[i] = reader
        load[reader] += need.nbytes
        heapq.heappush(heap, (load[reader], reader))
    return tuple(readers)
