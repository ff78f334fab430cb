"""The restore of a simulated job: which bytes each rank reads, planned by the product's
:meth:`spotrun.checkpoint.chunk_reader.ChunkReader.plan_units` from the parsed manifest, the
writers' indexes and each rank's reads, and the GETs that takes: the manifest, one index per
writer read from, two header reads per file read from (``ChunkReader.check``), and the read units.

Which rank reads which bytes is :meth:`RestorePlanner.plan`: cooperative (the product's restore
on several ranks: :mod:`tests.support.scale_model.share_side`, each shared box read once per
group of ranks that need it), or not (each rank reads everything it needs, as before the
cooperative restore: shown for comparison).

Ranks that read the same sizes from files of the same sizes form a class. At the save's own
layout where every rank reads back exactly what it wrote (cooperative: each shared piece read by
its writer, and no box of a replicated placement read alone; not cooperative: no replicated
placement at all) the save's classes give every rank's figures exactly; otherwise a sample of
ranks is planned (:attr:`RestorePlan.method`). Not cooperative, a read unit lies in one file, so a
rank's units are the sum of each file's: the tensors every rank reads whole (replicated state)
are planned once, and each rank's own boxes with them only in the files both touch.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from spotrun.checkpoint import tree
from spotrun.checkpoint.chunk_reader import BoxRead, ChunkReader, dtype_of
from spotrun.checkpoint.layout import index_name, shard_part_name
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_index import IndexedFile, RankIndex
from spotrun.checkpoint.share_plan import Need
from spotrun.checkpoint.stream import CHECKSUM_BLOCK_BYTES
from tests.support.scale_model.save_side import INCARNATION, RankClass, SavePlanner
from tests.support.scale_model.share_side import SharePlan, own_names, plan_sharing
from tests.support.scale_model.state import StateBuilder, box_at
from tests.support.scale_model.store import Store

#: At another layout than the save's, at most this many restoring ranks are planned.
SAMPLE_RANKS = 64

#: One read from storage: (writer rank, file path, start, stop).
Unit = tuple[int, str, int, int]


@dataclass
class RankReads:
    """What one restoring rank (a class's representative) reads."""

    rank: int
    units: list[Unit]
    plan_s: float  # the product's planning (ChunkReader.plan_units) for this rank
    dcp_items: list[int] = field(default_factory=list)  # bytes of each stored item DCP would read
    received: int = 0  # bytes it receives from the other ranks of its groups (cooperative)
    members: list[int] = field(default_factory=list)  # the ranks it stands for (itself among them)

    @property
    def writers(self) -> set[int]:
        return {u[0] for u in self.units}

    @property
    def files(self) -> set[tuple[int, str]]:
        return {(u[0], u[1]) for u in self.units}


@dataclass
class RestorePlan:
    """Every restoring rank's reads: classes of ranks (their count) with one rank's reads each."""

    world_size: int
    classes: list[tuple[int, RankReads]] = field(default_factory=list)
    method: str = "classes"
    """``"classes"`` (exact), ``"every rank"``, ``"sample"`` (each planned rank stands for as many) or ``"given"``."""
    manifest_parse_s: float = 0.0
    cooperative: bool = True
    share_s: float = 0.0  # the product's cooperative plan (plan_from_digests) for every rank


class _PlanningStorage:
    """The storage of a simulated restore: planning reads nothing from it, and asks only the size
    of its read units (``Storage.read_unit_bytes``, answered by the :class:`Store`)."""

    uri = "scale-model://"
    read_concurrency = 1

    def __init__(self, store: Store) -> None:
        self.read_unit_bytes = store.read_unit_bytes

    def __getattr__(self, name: str):
        raise AssertionError(f"the scale model's restore planning tried to use storage.{name}")


class RestorePlanner:
    """Plans the restore of a job saved by ``saved`` into ``builder``'s layout."""

    def __init__(self, saved: SavePlanner, classes: list[RankClass], manifest_json: bytes, builder: StateBuilder):
        self.saved, self.builder, self.store = saved, builder, saved.store
        started = time.perf_counter()
        self.manifest = Manifest.from_json(manifest_json)
        self.manifest_parse_s = time.perf_counter() - started
        self._class_of = {rank: c for c in classes for rank in c.ranks}
        self._indexes: dict[tuple[int, bool], RankIndex] = {}
        restored = builder.encoded(0)
        self._sharded = {n: (tuple(t.shape), tuple(t.placements)) for n, t in restored.sharded.items()}
        self._common = [n for n in tree.tensor_names(self.manifest.state) if n not in self._sharded]
        # the tensors of the restored state by name's first component and group (same shape and
        # placements: the same box on a rank; or "plain": whole tensors), for share_side
        self._group_names: dict[tuple[str, object], list[str]] = {}
        self._group_shape: dict[object, tuple] = {"plain": ()}
        for name in tree.tensor_names(self.manifest.state):
            group: object = "plain"
            if name in self._sharded and list(self._sharded[name][0]) == self.manifest.tensors[name].shape:
                group = self._sharded[name]
                self._group_shape[group] = group[0]
            self._group_names.setdefault((name.partition("/")[0], group), []).append(name)
        self.tensor_groups = [(c, g, self._group_shape[g]) for c, g in self._group_names]

    # --- the writers' indexes -----------------------------------------------------------------

    def index(self, writer: int, *, whole_only: bool) -> RankIndex:
        """``writer``'s index as the save wrote it (``whole_only``: only its whole tensors' entries,
        all that a read of replicated state looks up)."""
        if (writer, False) in self._indexes:
            return self._indexes[(writer, False)]
        if (writer, whole_only) not in self._indexes:
            files = self._class_of[writer].files  # its class's sizes and places
            keys = [entry[0] for entry in self.saved.writes(writer, "whole" if whole_only else "all")]
            indexed = [
                IndexedFile(shard_part_name(writer, INCARNATION, part), r.size_bytes, CHECKSUM_BLOCK_BYTES, [])
                for part, r in enumerate(files.records)
            ]
            chunks = dict(zip(keys, files.positions))
            self._indexes[(writer, whole_only)] = RankIndex(self.saved.step, writer, indexed, chunks)
        return self._indexes[(writer, whole_only)]

    # --- what a rank needs ----------------------------------------------------------------------

    def _box(self, name: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.group_box(self._sharded[name], rank)

    def group_box(self, group: object, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The box ``rank`` restores of the tensors of ``group`` (``None``: whole tensors)."""
        if group == "plain":
            return None
        shape, placements = group  # type: ignore[misc]
        return box_at(self.builder.layout, shape, placements, rank, self.saved.boxes)

    def segment_needs(self, key: tuple[str, bool], rank: int) -> list[Need]:
        """``rank``'s needs of one segment (``key``: first component, whole boxes), as
        ``fetch.fetch_shared`` makes them of its reads."""
        component, whole = key
        if component.startswith("rank-"):  # its own state
            reads = self._reads(own_names(self.manifest, rank), None)
        else:
            names = []
            for (c, group), members in self._group_names.items():
                box = self.group_box(group, rank)
                if c == component and (box is None or list(box[1]) == list(self._group_shape[group])) == whole:
                    names.extend(members)
            reads = self._reads(names, rank)
        return [Need(r.name, tuple(r.box[0]), tuple(r.box[1]), r.into.numel() * r.into.element_size()) for r in reads]

    def _reads(self, names: list[str], rank: int | None) -> list[BoxRead]:
        reads = []
        for name in names:
            record = self.manifest.tensors[name]
            if rank is not None and name in self._sharded and list(self._sharded[name][0]) == record.shape:
                box = self._box(name, rank)
            else:
                box = ((0,) * len(record.shape), tuple(record.shape))
            reads.append(self._read(name, box))
        return reads

    def _read(self, name: str, box: tuple[tuple[int, ...], tuple[int, ...]]) -> BoxRead:
        record = self.manifest.tensors[name]
        return BoxRead(name, record, box, torch.empty(box[1], dtype=dtype_of(record, name), device="meta"))

    @staticmethod
    def _writers(reads: list[BoxRead]) -> set[int]:
        return {c.writer for r in reads if math.prod(r.box[1]) for c in r.record.chunks.overlapping(r.box)}

    def _reader(self, reads: list[BoxRead], *, whole_only: bool) -> ChunkReader:
        indexes = {w: self.index(w, whole_only=whole_only) for w in self._writers(reads)}
        return ChunkReader(_PlanningStorage(self.store), self.manifest, indexes=indexes)  # type: ignore[arg-type]

    @staticmethod
    def _units(units: list[tuple]) -> list[Unit]:
        return [(index.rank, index.files[f].path, start, stop) for index, f, start, stop, _ in units]

    # --- who reads what -------------------------------------------------------------------------

    def plan(
        self, ranks: list[int] | None = None, sample: int = SAMPLE_RANKS, *, cooperative: bool = True
    ) -> RestorePlan:
        """Plan every restoring rank (by class, :meth:`_restore_classes`), or only ``ranks``:
        cooperative (:func:`~tests.support.scale_model.share_side.plan_sharing`), or each rank
        reading all it needs."""
        if not cooperative:
            return self._plan_alone(ranks, sample)
        world_size = self.builder.layout.world_size
        started = time.perf_counter()
        share = plan_sharing(self, world_size)
        result = RestorePlan(world_size, manifest_parse_s=self.manifest_parse_s, share_s=time.perf_counter() - started)
        groups, result.method = (
            self._restore_classes(sample, share) if ranks is None else ([(1, r, [r]) for r in ranks], "given")
        )
        for count, rank, members in groups:
            started = time.perf_counter()
            reads = [self._read(need.name, need.box) for need in share.reads(rank)]
            units = self._units(self._reader(reads, whole_only=False).plan_units(reads))
            elapsed = time.perf_counter() - started
            received = share.plan.bytes_received(rank)
            result.classes.append((count, RankReads(rank, units, elapsed, received=received, members=members)))
        return result

    def _plan_alone(self, ranks: list[int] | None, sample: int) -> RestorePlan:
        world_size = self.builder.layout.world_size
        common_reads = self._reads(self._common, None)
        common = self._units(self._reader(common_reads, whole_only=True).plan_units(common_reads))
        by_file: dict[tuple[int, str], list[Unit]] = {}
        for unit in common:
            by_file.setdefault((unit[0], unit[1]), []).append(unit)
        read_in: dict[tuple[int, str], list[BoxRead]] = {}
        for read in common_reads:  # a whole tensor: one chunk, in one of its writer's files
            (chunk,) = read.record.chunks.overlapping(read.box)
            index = self.index(chunk.writer, whole_only=True)
            read_in.setdefault((chunk.writer, index.files[index.chunks[read.name][0]].path), []).append(read)
        common_dcp = _whole_chunks(common_reads)
        result = RestorePlan(world_size, manifest_parse_s=self.manifest_parse_s, cooperative=False)
        groups, result.method = (
            self._restore_classes(sample) if ranks is None else ([(1, r, [r]) for r in ranks], "given")
        )
        for count, rank, members in groups:
            own = own_names(self.manifest, rank)
            own_reads = self._reads([n for n in self._sharded if n in self.manifest.tensors] + own, rank)
            started = time.perf_counter()
            # the replicated tensors in the files of the writers it reads its own boxes from go
            # into its plan too (a read unit may hold both)
            writers = self._writers(own_reads)
            extra = [r for (writer, _), reads in read_in.items() if writer in writers for r in reads]
            units = self._units(self._reader(own_reads + extra, whole_only=False).plan_units(own_reads + extra))
            elapsed = time.perf_counter() - started
            units += [u for (writer, path), us in by_file.items() if writer not in writers for u in us]
            dcp = common_dcp + _whole_chunks([r for r in own_reads if r.name not in set(own)])
            result.classes.append((count, RankReads(rank, units, elapsed, dcp, members=members)))
        return result

    def _restore_classes(
        self, sample: int, share: SharePlan | None = None
    ) -> tuple[list[tuple[int, int, list[int]]], str]:
        """(how many ranks it stands for, a restoring rank, those ranks) covering every restoring
        rank: where each rank reads back exactly what it wrote (the module docstring), the save's
        classes merged where their files hold the same bytes at the same places; else every rank,
        or ``sample`` ranks spread evenly, each standing for the ranks nearest to it."""
        layout = self.builder.layout
        if layout == self.saved.layout and self._reads_what_it_wrote(share):
            merged: dict[tuple, list[int]] = {}
            for c in self._class_of_values():
                f = c.files
                places = (tuple(r.size_bytes for r in f.records), tuple(f.header_bytes), tuple(f.positions))
                index_gets = self.store.whole_get_requests(f.index_record.size_bytes)  # its own index's size
                merged.setdefault((places, index_gets), []).extend(c.ranks)
            return [(len(ranks), min(ranks), ranks) for ranks in merged.values()], "classes"
        if layout.world_size <= sample:
            return [(1, r, [r]) for r in range(layout.world_size)], "every rank"
        step = (layout.world_size - 1) / (sample - 1)
        picked = sorted({round(i * step) for i in range(sample)})
        nearest: dict[int, list[int]] = {p: [] for p in picked}
        for rank in range(layout.world_size):
            nearest[min(picked[max(0, bisect.bisect(picked, rank) - 1) :][:2], key=lambda p: abs(p - rank))].append(
                rank
            )
        return [(len(ranks), p, ranks) for p, ranks in nearest.items()], "sample"

    def _reads_what_it_wrote(self, share: SharePlan | None) -> bool:
        """At the save's layout: whether every rank reads exactly the chunks it wrote."""
        replicated = {g for g in self._group_shape if g != "plain" and any(p.is_replicate() for p in g[1])}
        if share is None:  # each rank reads its boxes: written by itself unless a replica wrote them
            return not replicated
        alone_replicated = any(
            len(ranks) == 1 and any(group in replicated for group, _ in signature)
            for (_, signature), ranks in share.holders.items()
        )
        return not alone_replicated and share.readers_wrote_what_they_read(self.manifest)

    def _class_of_values(self) -> list[RankClass]:
        seen: dict[int, RankClass] = {}
        for c in self._class_of.values():
            seen.setdefault(id(c), c)
        return list(seen.values())


def restore_requests(
    store: Store, plan: RestorePlan, saved: SavePlanner, classes: list[RankClass], manifest_bytes: int
) -> tuple[Counter, Counter, list[tuple[float, int]]]:
    """GETs of the restore by kind and by key prefix, and (ranks, bytes read by each) per class.
    The manifest is read by rank 0 and relayed in a cooperative restore (``relay_manifest``),
    else by every rank."""
    class_of = {rank: c for c in classes for rank in c.ranks}
    kinds: Counter = Counter()
    prefixes: Counter = Counter()
    per_rank: list[tuple[float, int]] = []
    step = saved.step
    manifest_reads = 1 if plan.cooperative else plan.world_size
    kinds["manifest"] = prefixes[store.prefix(store.manifest_key(step, INCARNATION))] = (
        store.whole_get_requests(manifest_bytes) * manifest_reads
    )

    for count, reads in plan.classes:
        members = reads.members or [reads.rank]

        def ask(kind: str, gets: int, writer: int, path: str, count=count, reads=reads, members=members) -> None:
            kinds[kind] += gets * count
            if writer != reads.rank:
                prefixes[store.prefix(store.key(step, writer, path))] += gets * count
                return
            for member in members:  # each reads its own file: under its own prefix
                prefixes[store.prefix(store.key(step, member, path))] += gets * count / len(members)

        for writer in reads.writers:
            size = class_of[writer].files.index_record.size_bytes
            ask("index", store.whole_get_requests(size), writer, index_name(writer, INCARNATION))
        for writer, path in reads.files:  # ChunkReader._header: the 8-byte length, then the JSON
            header = class_of[writer].files.header_bytes[_part_of(path)]
            gets = store.ranged_get_requests(8) + store.ranged_get_requests(header - 8)
            ask("header", gets, writer, path)
        for writer, path, start, stop in reads.units:
            ask("data", store.ranged_get_requests(stop - start), writer, path)
        per_rank.append((count, sum(stop - start for _, _, start, stop in reads.units)))
    return kinds, prefixes, per_rank


def _whole_chunks(reads: list[BoxRead]) -> list[int]:
    """Bytes of every stored chunk ``reads`` overlap: what DCP's reader fetches (it reads a
    stored item whole, then narrows it to the box)."""
    found = []
    for read in reads:
        if math.prod(read.box[1]):
            itemsize = read.into.element_size()
            found.extend(c.numel * itemsize for c in read.record.chunks.overlapping(read.box))
    return found


def dcp_restore_requests(
    store: Store, plan: RestorePlan, metadata_bytes: int
) -> tuple[Counter, list[tuple[float, int]]]:
    """DCP's load through the same store: every rank reads ``.metadata`` whole, then each stored
    item it needs with one ranged read."""
    kinds: Counter = Counter()
    per_rank = []
    for count, reads in plan.classes:
        kinds["metadata"] += store.whole_get_requests(metadata_bytes) * count
        kinds["data"] += sum(store.ranged_get_requests(n) for n in reads.dcp_items) * count
        per_rank.append((count, sum(reads.dcp_items)))
    return kinds, per_rank


def _part_of(path: str) -> int:
    return int(path.split(".part-")[1].split(".")[0]) if ".part-" in path else 0
