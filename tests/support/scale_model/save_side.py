"""The save of a simulated job: what each rank writes, its files, its index and its report, and
the manifest rank 0 builds from the reports.

Which rank writes which chunk is read off rank 0's state the way rank 0 itself describes it in
the manifest: replicated tensors by :func:`~spotrun.checkpoint.write_plan.replicated_owners`, each
DTensor's chunks by torch's sharding arithmetic at every mesh coordinate (what ``local_box`` asks
``DTensor``), written by the replica :func:`spotrun.checkpoint.sharded.writes_chunk` chooses and
reported unless :func:`~spotrun.checkpoint.sharded.predicted_grid` predicts them. Ranks whose plans
have the same shape (the same chunk lengths, key lengths and rank digits: every size in their
files and index is then the same) form a class; one rank per class goes through the product's
file planning (``split_into_parts``, ``shard_file``, ``index_entry``, ``RankIndex.to_json``,
``write_index``), the others share its sizes. A few ranks are also planned from their own meta
DTensors with :func:`~spotrun.checkpoint.write_plan.plan_writes`, as ``prepare_save`` plans them,
and must come out identical (:meth:`SavePlanner.check_rank`).
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from spotrun.checkpoint.chunks import ChunkLayout
from spotrun.checkpoint.encode import encode_state
from spotrun.checkpoint.layout import index_name, shard_part_name
from spotrun.checkpoint.manifest import FileRecord
from spotrun.checkpoint.manifest_build import build_manifest
from spotrun.checkpoint.rank_index import RankIndex, chunk_key
from spotrun.checkpoint.save import SaveContext
from spotrun.checkpoint.shard import ShardLimits, split_into_parts
from spotrun.checkpoint.shard_write import index_entry, shard_file, write_index
from spotrun.checkpoint.sharded import _replica_coordinates, predicted_grid
from spotrun.checkpoint.stream import CHECKSUM_BLOCK_BYTES, CHUNKED_BLAKE3
from spotrun.checkpoint.write_plan import plan_writes, replicated_owners, save_report
from tests.support.scale_model.state import Box, Layout, StateBuilder, box_at, rank_state
from tests.support.scale_model.store import Store

#: A digest's length in hex (BLAKE3 and SHA-256 alike): stands for every digest in a simulated file.
DIGEST = "0" * 64
INCARNATION = 1
#: A save's write time in the reports (only its length in the manifest matters).
WRITE_S = 12.345678

#: One chunk a rank writes: (chunk key, tensor name, offsets, lengths, reported to rank 0).
Entry = tuple[str, str, tuple[int, ...], tuple[int, ...], bool]


@dataclass
class RankFiles:
    """The files of one rank (a class's representative): their records and header sizes, its index."""

    records: list[FileRecord]
    header_bytes: list[int]  # each data file's safetensors header (the 8-byte length included)
    index: RankIndex
    index_record: FileRecord
    positions: list[tuple[int, int, int]]  # (file, begin, end) of each entry, in plan order


@dataclass
class RankClass:
    """Ranks whose files have the same sizes, and their representative's files."""

    ranks: list[int]
    files: RankFiles


@dataclass
class _Group:
    """DTensors of rank 0's state with one shape, dtype, placements and writing replica:
    rank -> (offsets, lengths, reported) of the chunk it writes."""

    shape: tuple[int, ...]
    first_name: str
    chunks: dict[int, tuple[tuple[int, ...], tuple[int, ...], bool]] = field(default_factory=dict)


class SavePlanner:
    """Plans the save of every rank of one simulated job (see the module docstring)."""

    def __init__(self, builder: StateBuilder, store: Store, step: int, limits: ShardLimits | None = None) -> None:
        self.builder, self.store, self.step = builder, store, step
        self.layout: Layout = builder.layout
        self.world_size = self.layout.world_size
        self.limits = limits or ShardLimits()
        self.encoded = builder.encoded(0)
        self.owner = replicated_owners(self.encoded, self.world_size)
        self.owned: dict[int, list[str]] = defaultdict(list)
        for name in self.encoded.tensors:
            self.owned[self.owner[name]].append(name)
        self._rank_state = rank_state(0, len(builder.parameters) if self.layout.kind == "ddp" else 0)
        self._groups: list[_Group] = []
        self._group_of: dict[str, int] = {}
        self.boxes: dict[tuple, Box] = {}  # box_at's memo, shared with the restore's planning
        self._group_dtensors()
        reporting = {gi for gi, g in enumerate(self._groups) if any(c[2] for c in g.chunks.values())}
        self._reported_names = [n for n in self.encoded.sharded if self._group_of[n] in reporting]
        self._meta: dict[tuple, torch.Tensor] = {}

    # --- which rank writes which chunk -------------------------------------------------------

    def _group_dtensors(self) -> None:
        mesh_shape = self.layout.mesh_shape
        ranks = torch.arange(self.world_size).view(mesh_shape)
        keyed: dict[tuple, int] = {}
        for name, tensor in self.encoded.sharded.items():
            shape, placements = tuple(tensor.shape), tuple(tensor.placements)
            chosen = _replica_coordinates(tensor, name)
            key = (shape, tensor.dtype, repr(placements), tuple(sorted(chosen.items())))
            if key in keyed:
                self._group_of[name] = keyed[key]
                continue
            # the chunks rank 0 records for it without being told (the manifest's grid)
            predicted = predicted_grid(tensor, name)
            recorded = {}
            if predicted is not None:
                layout = ChunkLayout(list(shape), grid=predicted[0], writers=predicted[1])
                recorded = {c.writer: (c.offsets, c.lengths) for c in layout.chunks()}
            group = _Group(shape, name)
            writers = ranks[tuple(chosen.get(d, slice(None)) for d in range(len(mesh_shape)))].reshape(-1).tolist()
            for rank in writers:
                box = box_at(self.layout, shape, placements, rank, self.boxes)
                if 0 not in box[1]:  # an empty chunk is not written
                    group.chunks[rank] = (box[0], box[1], recorded.get(rank) != box)
            keyed[key] = self._group_of[name] = len(self._groups)
            self._groups.append(group)

    def group(self, name: str) -> _Group:
        """The group of DTensor ``name``: which rank writes which chunk of it."""
        return self._groups[self._group_of[name]]

    def rank_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """``rank``'s own tensors, named as it encodes them."""
        return encode_state({}, self._rank_state, rank).rank_tensors

    def writes(self, rank: int, which: str = "all", own: dict[str, torch.Tensor] | None = None) -> list[Entry]:
        """What ``rank`` writes, in file order (see the module docstring); ``which``: ``"all"``,
        ``"reported"`` (the chunks it reports to rank 0) or ``"whole"`` (its whole tensors, first
        in its files: its share of the replicated ones and its own)."""
        found: list[Entry] = []
        for name in self.owned.get(rank, []):
            t = self.encoded.tensors[name]
            found.append((name, name, (0,) * t.dim(), tuple(t.shape), True))
        for name, t in (self.rank_tensors(rank) if own is None else own).items():
            found.append((name, name, (0,) * t.dim(), tuple(t.shape), True))
        if which == "whole":
            return found
        names = self._reported_names if which == "reported" else self.encoded.sharded
        for name in names:
            group = self._groups[self._group_of[name]]
            chunk = group.chunks.get(rank)
            if chunk is not None and (chunk[2] or which == "all"):
                offsets, lengths, reported = chunk
                found.append((chunk_key(name, offsets, lengths, group.shape), name, offsets, lengths, reported))
        return found

    def classes(self) -> list[RankClass]:
        """Every rank in a class of ranks with same-sized files (see the module docstring)."""
        parts: dict[int, list] = defaultdict(list)
        for gi, group in enumerate(self._groups):
            named = len(group.first_name)
            for rank, (offsets, lengths, reported) in group.chunks.items():
                suffix = len(chunk_key(group.first_name, offsets, lengths, group.shape)) - named
                parts[rank].append((gi, lengths, suffix, reported))
        by_signature: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(self.world_size):
            # a replicated tensor's name matters by its length only (like every key)
            owned = tuple((len(n), tuple(self.encoded.tensors[n].shape)) for n in self.owned.get(rank, ()))
            signature = (len(str(rank)), owned, tuple(parts.get(rank, ())))
            by_signature[signature].append(rank)
        return [RankClass(ranks, self.files(ranks[0], self.writes(ranks[0]))) for ranks in by_signature.values()]

    # --- the product's file planning ---------------------------------------------------------

    def _tensor(self, name: str, lengths: tuple[int, ...], rank_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if name in rank_tensors:
            return rank_tensors[name]
        if name in self.encoded.tensors:
            return self.encoded.tensors[name]
        return self._meta_like(torch.empty(lengths, dtype=self.encoded.sharded[name].dtype, device="meta"))

    def _meta_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A meta tensor of ``tensor``'s shape and dtype (one per pair: only sizes are read)."""
        key = (tuple(tensor.shape), tensor.dtype)
        if key not in self._meta:
            self._meta[key] = torch.empty(key[0], dtype=key[1], device="meta")
        return self._meta[key]

    def files(self, rank: int, entries: list[Entry]) -> RankFiles:
        """``rank``'s files and index for ``entries``, planned by the product's write path."""
        own = self.rank_tensors(rank)
        tensors = {key: self._tensor(name, lengths, own) for key, name, _, lengths, _ in entries}
        return self._files(rank, tensors)

    def _files(self, rank: int, tensors: dict[str, torch.Tensor]) -> RankFiles:
        # an expanded stand-in (DDP's) as the meta tensor of its shape: a file would copy it whole
        tensors = {k: t if t.is_contiguous() else self._meta_like(t) for k, t in tensors.items()}
        records, headers, indexed, located = [], [], [], {}
        for part, names in enumerate(split_into_parts(tensors, self.limits)):
            path, source = shard_file(self.step, rank, INCARNATION, part, tensors, names)
            blocks = -(-source.size_bytes // CHECKSUM_BLOCK_BYTES)
            entry, where = index_entry(part, path, source, [DIGEST] * blocks)
            indexed.append(entry)
            located.update(where)
            headers.append(len(source.header))
            # as write_shard records a file it wrote
            records.append(FileRecord(path, rank, source.size_bytes, DIGEST, CHUNKED_BLAKE3, CHECKSUM_BLOCK_BYTES))
        index = RankIndex(step=self.step, rank=rank, files=indexed, chunks=located)
        index_record = write_index(_Recorder(), index, INCARNATION, self.store.key_layout)
        return RankFiles(records, headers, index, index_record, [located[key] for key in tensors])

    def check_rank(self, rank: int, rank_class: RankClass) -> float:
        """Plan ``rank`` from its own meta DTensors as ``prepare_save`` does and check that it writes
        what :meth:`writes` says, into files of the sizes and places of its class
        (``rank_class``); returns the seconds the product's planning took (encoding,
        :func:`plan_writes`, ``split_into_parts``, the files' headers, the index).

        Raises:
            AssertionError: they differ (the scale model no longer matches the product).
        """
        replicated, rank_local = self.builder.state(rank)
        started = time.perf_counter()
        encoded = encode_state(replicated, rank_local, rank)
        plan = plan_writes(encoded, rank, self.world_size, self.owner)
        files = self._files(rank, plan.tensors)
        elapsed = time.perf_counter() - started
        product = [(k, *plan.chunks[k], k in plan.reported) for k in plan.tensors]
        assert product == self.writes(rank), f"rank {rank}: the product's plan differs from the scale model's"
        mine = rank_class.files
        assert [r.size_bytes for r in files.records] == [r.size_bytes for r in mine.records], f"rank {rank}: files"
        assert files.header_bytes == mine.header_bytes, f"rank {rank}: headers"
        assert files.positions == mine.positions, f"rank {rank}: chunk places"
        assert files.index_record.size_bytes == mine.index_record.size_bytes, f"rank {rank}: index"
        return elapsed

    # --- the reports and the manifest ---------------------------------------------------------

    def report(self, rank: int, rank_class: RankClass) -> dict[str, Any]:
        """The report ``rank`` sends rank 0 (:func:`~spotrun.checkpoint.write_plan.save_report`)."""
        files = rank_class.files
        records = [
            FileRecord(
                shard_part_name(rank, INCARNATION, part), rank, r.size_bytes, r.digest, r.algorithm, r.chunk_bytes
            )
            for part, r in enumerate(files.records)
        ]
        index = files.index_record
        records.append(FileRecord(index_name(rank, INCARNATION), rank, index.size_bytes, index.digest))
        encoded = encode_state({}, self._rank_state, rank)
        writes = self.writes(rank, "reported", encoded.rank_tensors)
        return save_report(encoded, {key: (name, o, n) for key, name, o, n, _ in writes}, records, WRITE_S)

    def manifest(self, classes: list[RankClass]) -> tuple[bytes, int, float]:
        """The manifest rank 0 commits (:func:`spotrun.checkpoint.manifest_build.build_manifest`), the
        bytes of the reports every rank gathers for it (``all_gather_json``), and the seconds rank 0
        takes to build it and write it as JSON."""
        class_of = {rank: c for c in classes for rank in c.ranks}
        reports = [self.report(rank, class_of[rank]) for rank in range(self.world_size)]
        gathered = sum(len(json.dumps(r, allow_nan=False)) for r in reports)  # as all_gather_json sends them
        context = SaveContext("periodic", "scale-model", INCARNATION)
        started = time.perf_counter()
        layout = self.store.key_layout
        data = build_manifest(self.step, self.encoded, reports, context, self.world_size, layout).to_json()
        return data, gathered, time.perf_counter() - started


class _Recorder:
    """A storage that only notes what is put into it (for ``write_index``)."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, int]] = []

    def put(self, key: str, data: bytes) -> None:
        self.puts.append((key, len(data)))


def save_requests(store: Store, step: int, classes: list[RankClass], manifest_bytes: int) -> tuple[Counter, Counter]:
    """Every request of the save, by kind, and by key prefix."""
    kinds: Counter = Counter()
    prefixes: Counter = Counter()
    for rank_class in classes:
        files = rank_class.files
        for rank in rank_class.ranks:
            paths = [(shard_part_name(rank, INCARNATION, p), r.size_bytes, True) for p, r in enumerate(files.records)]
            paths.append((index_name(rank, INCARNATION), files.index_record.size_bytes, False))
            for path, size, streamed in paths:
                asked = store.upload_requests(size, streamed=streamed)
                kinds.update(asked)
                prefixes[store.prefix(store.key(step, rank, path))] += sum(asked.values())
    asked = store.commit_requests(manifest_bytes)
    kinds.update(asked)
    prefixes[store.prefix(store.manifest_key(step, INCARNATION))] += sum(asked.values())
    return kinds, prefixes
