"""The restore of a simulated job: which bytes each rank reads, planned by the product's
:meth:`spotrun.checkpoint.chunk_reader.ChunkReader.plan_units` from the parsed manifest, the
writers' indexes and each rank's boxes (as ``fetch_chunked`` asks for them), and the GETs that
takes: the manifest, one index per writer read from, two header reads per file read from
(``ChunkReader.check``), and the read units.

A read unit lies in one file, so a rank's units are the sum of each file's: the tensors every
rank reads whole (replicated state) are planned once, and each rank's own boxes with them only
in the files both touch. Ranks that read the same sizes from files of the same sizes form a
class (at the save's own layout: the save's classes); at another layout a sample of ranks is
planned (:attr:`RestorePlan.method`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from spotrun.checkpoint import tree
from spotrun.checkpoint.chunk_reader import BoxRead, ChunkReader, dtype_of
from spotrun.checkpoint.layout import index_name, manifest_name, shard_part_name
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_index import IndexedFile, RankIndex
from spotrun.checkpoint.stream import CHECKSUM_BLOCK_BYTES
from tests.support.scale_model.save_side import INCARNATION, RankClass, SavePlanner
from tests.support.scale_model.state import StateBuilder
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


class _NoStorage:
    """The storage of a simulated restore: planning reads nothing from it."""

    uri = "scale-model://"
    read_concurrency = 1

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
        self._boxes: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._common = [n for n in tree.tensor_names(self.manifest.state) if n not in self._sharded]

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

    # --- what a rank reads ----------------------------------------------------------------------

    def _box(self, name: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape, placements = self._sharded[name]
        layout = self.builder.layout
        cut = (shape, repr(placements), layout.coordinate(rank))
        if cut not in self._boxes:
            lengths, offsets = _compute_local_shape_and_global_offset(
                shape, layout.mesh_shape, list(layout.coordinate(rank)), placements
            )
            self._boxes[cut] = (tuple(offsets), tuple(lengths))
        return self._boxes[cut]

    def _reads(self, names: list[str], rank: int | None) -> list[BoxRead]:
        reads = []
        for name in names:
            record = self.manifest.tensors[name]
            if rank is not None and name in self._sharded and list(self._sharded[name][0]) == record.shape:
                box = self._box(name, rank)
            else:
                box = ((0,) * len(record.shape), tuple(record.shape))
            into = torch.empty(box[1], dtype=dtype_of(record, name), device="meta")
            reads.append(BoxRead(name, record, box, into))
        return reads

    @staticmethod
    def _writers(reads: list[BoxRead]) -> set[int]:
        return {c.writer for r in reads if math.prod(r.box[1]) for c in r.record.chunks.overlapping(r.box)}

    def _reader(self, reads: list[BoxRead], *, whole_only: bool) -> ChunkReader:
        indexes = {w: self.index(w, whole_only=whole_only) for w in self._writers(reads)}
        return ChunkReader(_NoStorage(), self.manifest, indexes=indexes)  # type: ignore[arg-type]

    @staticmethod
    def _units(units: list[tuple]) -> list[Unit]:
        return [(index.rank, index.files[f].path, start, stop) for index, f, start, stop, _ in units]

    def plan(self, ranks: list[int] | None = None, sample: int = SAMPLE_RANKS) -> RestorePlan:
        """Plan every restoring rank (by class, :meth:`_restore_classes`), or only ``ranks``."""
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
        result = RestorePlan(world_size, manifest_parse_s=self.manifest_parse_s)
        groups, result.method = self._restore_classes(sample) if ranks is None else ([(1, r) for r in ranks], "given")
        for count, rank in groups:
            source = rank % self.manifest.world_size
            own_names = [n for n in self._sharded if n in self.manifest.tensors]
            own_names += tree.tensor_names(self.manifest.rank_state[source])
            own_reads = self._reads(own_names, rank)
            started = time.perf_counter()
            # the replicated tensors in the files of the writers it reads its own boxes from go
            # into its plan too (a read unit may hold both)
            writers = self._writers(own_reads)
            extra = [r for (writer, _), reads in read_in.items() if writer in writers for r in reads]
            units = self._units(self._reader(own_reads + extra, whole_only=False).plan_units(own_reads + extra))
            elapsed = time.perf_counter() - started
            units += [u for (writer, path), us in by_file.items() if writer not in writers for u in us]
            own_tensors = set(tree.tensor_names(self.manifest.rank_state[source]))
            dcp = common_dcp + _whole_chunks([r for r in own_reads if r.name not in own_tensors])
            result.classes.append((count, RankReads(rank, units, elapsed, dcp)))
        return result

    def _restore_classes(self, sample: int) -> tuple[list[tuple[float, int]], str]:
        """(ranks it stands for, a restoring rank) covering every restoring rank: at the save's own
        layout without replicated DTensors, where each rank reads back its own chunks, the save's
        classes merged where their files hold the same bytes at the same places; else every rank,
        or ``sample`` ranks spread evenly, each standing for as many."""
        layout = self.builder.layout
        if layout == self.saved.layout and not any(p.is_replicate() for _, ps in self._sharded.values() for p in ps):
            merged: dict[tuple, list[int]] = {}
            for c in self._class_of_values():
                f = c.files
                places = (tuple(r.size_bytes for r in f.records), tuple(f.header_bytes), tuple(f.positions))
                index_gets = self.store.whole_get_requests(f.index_record.size_bytes)  # its own index's size
                merged.setdefault((places, index_gets), []).extend(c.ranks)
            return [(len(ranks), min(ranks)) for ranks in merged.values()], "classes"
        if layout.world_size <= sample:
            return [(1, r) for r in range(layout.world_size)], "every rank"
        step = (layout.world_size - 1) / (sample - 1)
        picked = sorted({round(i * step) for i in range(sample)})
        return [(layout.world_size / len(picked), r) for r in picked], "sample"

    def _class_of_values(self) -> list[RankClass]:
        seen: dict[int, RankClass] = {}
        for c in self._class_of.values():
            seen.setdefault(id(c), c)
        return list(seen.values())


def restore_requests(
    store: Store, plan: RestorePlan, saved: SavePlanner, classes: list[RankClass], manifest_bytes: int
) -> tuple[Counter, Counter, list[tuple[float, int]]]:
    """GETs of the restore by kind and by key prefix, and (ranks, bytes read by each) per class."""
    class_of = {rank: c for c in classes for rank in c.ranks}
    kinds: Counter = Counter()
    prefixes: Counter = Counter()
    per_rank: list[tuple[float, int]] = []
    step = saved.step

    def ask(kind: str, count: float, gets: int, rank: int, path: str) -> None:
        kinds[kind] += gets * count
        prefixes[store.prefix(store.key(step, rank, path))] += gets * count

    for count, reads in plan.classes:
        ask("manifest", count, store.whole_get_requests(manifest_bytes), 0, manifest_name(INCARNATION))
        for writer in reads.writers:
            size = class_of[writer].files.index_record.size_bytes
            ask("index", count, store.whole_get_requests(size), writer, index_name(writer, INCARNATION))
        for writer, path in reads.files:  # ChunkReader._header: the 8-byte length, then the JSON
            header = class_of[writer].files.header_bytes[_part_of(path)]
            gets = store.ranged_get_requests(8) + store.ranged_get_requests(header - 8)
            ask("header", count, gets, writer, path)
        for writer, path, start, stop in reads.units:
            ask("data", count, store.ranged_get_requests(stop - start), writer, path)
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
