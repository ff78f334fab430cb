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
rank alone with a segment reads it as it would without peers. The rules: ``docs/design/internals.md``
(Cooperative restore).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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
    return {_digest(found): found for found in (tuple(sorted(v)) for v in by_key.values())}


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
    found = [segments(needs, manifest) for needs in needs_by_rank]
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
        needs = sorted(n for d in digests for n in known[d] if n.nbytes)
        if len(ranks) == 1:
            alone[ranks[0]] = needs
        elif needs:
            groups.append(ShareGroup(ranks, tuple(needs), assign_readers(needs, ranks, manifest)))
    return ReadPlan(groups, alone)


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
    :func:`spotrun.checkpoint.plan.assign_by_bytes`), each to the least loaded of its writers
    among ``ranks`` unless that rank would then read more than ``total / len(ranks)`` plus the
    largest need, else to the least loaded rank (ties to the lowest). At the world size that
    saved, a DDP rank so reads exactly what it wrote (that save's greedy plan never exceeds this
    bound) and only its own index; a group none of whose ranks wrote a need still splits it by bytes.
    """
    if not needs:
        return ()
    members = set(ranks)
    count = len(ranks)
    total = sum(n.nbytes for n in needs)
    bound = total + max(n.nbytes for n in needs) * count  # a load times count must stay at or under it
    load = dict.fromkeys(ranks, 0)
    heap = [(0, r) for r in sorted(ranks)]  # (load, rank); entries go stale as loads grow
    readers: list[int] = [0] * len(needs)
    for i in sorted(range(len(needs)), key=lambda i: (-needs[i].nbytes, needs[i])):
        need = needs[i]
        own = [w for w in writers_of(need, manifest) if w in members]
        reader = min(own, key=lambda r: (load[r], r)) if own else None
        if reader is None or (load[reader] + need.nbytes) * count > bound:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            reader = heap[0][1]
        readers[i] = reader
        load[reader] += need.nbytes
        heapq.heappush(heap, (load[reader], reader))
    return tuple(readers)
