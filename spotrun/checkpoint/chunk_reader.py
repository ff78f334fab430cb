"""Reading boxes of global tensors out of the chunks that hold them, whatever layout wrote
them (format 4): the resharding restore.

Each rank reads the box of every tensor it holds now straight into that tensor's memory
(scatter reads), never assembling a tensor it does not hold in full. Before a byte is read,
:meth:`ChunkReader.check` makes the checks ``spotrun verify`` makes; then every byte read is
verified in 1 MiB blocks. Details: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import torch

from spotrun.checkpoint.chunks import Box, byte_runs, overlap
from spotrun.checkpoint.layout import file_key
from spotrun.checkpoint.manifest import FileRecord, Manifest, TensorRecord
from spotrun.checkpoint.rank_index import RankIndex, chunk_key
from spotrun.checkpoint.read_slabs import ScratchPool, Slab
from spotrun.checkpoint.reader import _dtype_info, _read
from spotrun.checkpoint.step_checks import block_problems, parse_index
from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES, byte_view
from spotrun.checkpoint.strict_json import INDEX_MAX_BYTES
from spotrun.checkpoint.verify_tensors import ShardHeader, check_chunk, coverage_problem, read_header
from spotrun.errors import CorruptShardError
from spotrun.storage.base import Storage
from spotrun.tools.progress import progress_bar


@dataclass
class BoxRead:
    """One box to read: of tensor ``name`` (its manifest ``record``), into ``into``
    (a contiguous CPU tensor of the record's dtype and the box's lengths)."""

    name: str
    record: TensorRecord
    box: Box
    into: torch.Tensor


#: Overlaps whose contiguous runs are shorter than this (a column slice of rows, e.g. a
#: row-wise tensor-parallel shard of a row-sharded save) are read as whole rows into a
#: scratch buffer of at most CHECKSUM_CHUNK_BYTES and copied from there with one strided copy,
#: instead of one scatter entry per run. Only for rows of at most one block, whose bytes the
#: block checksums make this rank read anyway.
SMALL_RUN_BYTES = 64 * 2**10


@dataclass
class _Piece:
    begin: int  # byte range [begin, end) of the file
    end: int
    target: torch.Tensor | None  # 1-D uint8 view of the receiving memory, or None: a slab's
    slab: Slab | None = None
    slab_offset: int = 0  # where [begin, end) starts in the slab


def dtype_of(record: TensorRecord, where: str) -> torch.dtype:
    """The torch dtype of a record.

    Raises:
        CorruptShardError: a dtype this torch lacks or cannot decode.
    """
    dtype, problem = _dtype_info(record.dtype)
    if problem is not None:
        raise CorruptShardError(f"{where}: {problem}")
    assert dtype is not None
    return dtype


class ChunkReader:
    """Reads boxes of one step's tensors (see the module docstring).

    Args:
        storage: where the step lies.
        manifest: its manifest (format 4).
        progress: a :func:`~spotrun.tools.progress.progress_bar` with this description over the
            bytes of each :meth:`read` (on a terminal, for reads of more than a few seconds);
            ``None``: no bar.
        indexes: writer rank -> its index, already read and checked (the others are read when needed).
    """

    def __init__(
        self, storage: Storage, manifest: Manifest, *, progress: str | None = None, indexes: dict | None = None
    ) -> None:
        self._storage = storage
        self._manifest = manifest
        self._files: dict[str, FileRecord] = {f.path: f for f in manifest.files}
        self._index_of_rank: dict[int, FileRecord] = {
            f.rank: f for f in manifest.files if f.path.endswith(".index.json")
        }
        self._indexes: dict[int, RankIndex] = dict(indexes or {})
        self._headers: dict[str, ShardHeader] = {}
        self._covered: set[str] = set()  # tensors whose chunk layout passed coverage_problem
        self._checked: set[tuple[str, Box]] = set()
        self._lock = threading.Lock()
        self._scratch = ScratchPool()
        self._progress = progress
        self._bar = None
        self.bytes_read = 0

    def _index(self, rank: int) -> RankIndex:
        if rank in self._indexes:
            return self._indexes[rank]
        record = self._index_of_rank.get(rank)
        step = self._manifest.step
        if record is None:
            raise CorruptShardError(f"step {step}: the manifest lists no index of rank {rank}")
        where = self._where(record.path)
        if record.size_bytes > INDEX_MAX_BYTES:  # its size on storage (the catalog checked): not read
            raise CorruptShardError(
                f"{where}: {record.size_bytes} bytes, more than the {INDEX_MAX_BYTES} a rank index may have"
            )
        data = self._storage.get(file_key(step, record, self._manifest))
        self.bytes_read += len(data)
        try:  # the checks spotrun verify makes of it
            index = parse_index(data, record, self._manifest)
        except CorruptShardError as exc:
            raise CorruptShardError(f"{where}: {exc}") from exc
        for problem in block_problems(index, self._manifest).values():
            raise CorruptShardError(f"{where}: {problem}")
        self._indexes[rank] = index
        return index

    def _key(self, path: str) -> str:
        """The key of a file the manifest lists (every caller checked that it does)."""
        return file_key(self._manifest.step, self._files[path], self._manifest)

    def _where(self, path: str) -> str:
        if path not in self._files:
            return f"{self._storage.uri} step {self._manifest.step}: {path}"
        return f"{self._storage.uri}/{self._key(path)}"

    def _header(self, path: str) -> ShardHeader:
        """The safetensors header of data file ``path``, which must describe a valid file of
        the size the manifest records (the catalog listed it with that size)."""
        header = self._headers.get(path)
        if header is None:
            record = self._files.get(path)
            if record is None:  # parse_index made sure the manifest lists it
                raise CorruptShardError(f"{self._where(path)}: not in the manifest")
            try:
                header = read_header(self._storage, self._key(path), record.size_bytes, record.size_bytes)
            except CorruptShardError as exc:
                raise CorruptShardError(f"{self._where(path)}: {exc}") from exc
            for problem in header.problems:
                raise CorruptShardError(f"{self._where(path)}: {problem}")
            self.bytes_read += header.data_start
            self._headers[path] = header
        return header

    def check(self, boxes: list[tuple[str, TensorRecord, Box]]) -> None:
        """Check what reading each box of a tensor (name, manifest record, box) relies on, as
        ``spotrun verify`` does (:mod:`spotrun.checkpoint.verify_tensors`): the tensor's chunks
        cover it exactly once, and every chunk the box overlaps is in its writer's index (itself
        checked against the manifest) and in its file's header with the recorded dtype, shape
        and bytes, at the bytes the index says. Reads index files and headers only.

        Raises:
            CorruptShardError: the first disagreement, naming the file and the reason.
            StorageError: a read failed.
        """
        step = self._manifest.step
        for name, record, box in boxes:
            box = (tuple(box[0]), tuple(box[1]))
            if (name, box) in self._checked:
                continue
            where = f"step {step}: tensor {name!r}"
            if record.chunks is None:
                raise CorruptShardError(f"{where}: the manifest lists no chunks of it")
            dtype_of(record, where)
            if name not in self._covered:
                problem = coverage_problem(name, record)
                if problem is not None:
                    raise CorruptShardError(f"step {step}: {problem}")
                self._covered.add(name)
            if math.prod(box[1]):
                for chunk in record.chunks.overlapping(box):
                    index = self._index(chunk.writer)
                    found = check_chunk(
                        name, record, chunk, self._index_of_rank[chunk.writer].path, index, self._header
                    )
                    if found is not None:
                        raise CorruptShardError(f"{self._where(found[0] or '')}: {found[1]}")
            self._checked.add((name, box))

    def read(self, reads: list[BoxRead]) -> None:
        """Fill every ``into`` with its box, verifying each block read; nothing is read into
        any of them before every box passed :meth:`check`.

        Raises:
            CorruptShardError: a chunk missing from its writer's index, a block whose
                digest differs, a file shorter than recorded, a malformed index, anything
                :meth:`check` finds.
            StorageError: a read failed.
        """
        self.check([(item.name, item.record, item.box) for item in reads])
        units = self.plan_units(reads)
        total_bytes = sum(stop - start for _, _, start, stop, _ in units)
        with progress_bar(total_bytes, self._progress or "", show=self._progress is not None) as self._bar:
            if len(units) <= 1:
                for unit in units:
                    self._read_unit(*unit)
                return
            with ThreadPoolExecutor(
                max_workers=min(self._storage.read_concurrency, len(units)), thread_name_prefix="spotrun-read"
            ) as pool:
                for future in [pool.submit(self._read_unit, *unit) for unit in units]:
                    future.result()

    def plan_units(self, reads: list[BoxRead]) -> list[tuple]:
        """The read units of ``reads``, ``(writer's index, file number, start, stop, pieces)``: whole
        blocks of one file, each up to the store's read unit for the planned bytes
        (:meth:`~spotrun.storage.base.Storage.read_unit_bytes`; checks nothing: :meth:`read` does)."""
        pieces: dict[tuple[int, int], list[_Piece]] = {}  # (writer rank, file index) -> pieces
        for item in reads:
            self._plan(item, pieces)
        blocks = {
            (rank, file_index): self._blocks(self._indexes[rank].files[file_index].block_bytes, file_pieces)
            for (rank, file_index), file_pieces in pieces.items()
        }
        # units grow with the read on an object store (one GET each), stay small on files
        planned_bytes = sum(
            len(numbers) * self._indexes[rank].files[file_index].block_bytes
            for (rank, file_index), numbers in blocks.items()
        )
        unit_bytes = self._storage.read_unit_bytes(planned_bytes, CHECKSUM_CHUNK_BYTES)
        units = []
        for (rank, file_index), file_pieces in pieces.items():
            units.extend(
                self._units(self._indexes[rank], file_index, file_pieces, blocks[rank, file_index], unit_bytes)
            )
        return units

    def _plan(self, item: BoxRead, pieces: dict[tuple[int, int], list[_Piece]]) -> None:
        record = item.record
        where = f"step {self._manifest.step}: tensor {item.name!r}"
        itemsize = dtype_of(record, where).itemsize
        target = byte_view(item.into)
        box_offsets, box_lengths = item.box
        if math.prod(box_lengths) == 0:
            return
        assert record.chunks is not None
        writer = record.chunks.whole_writer
        if writer is not None and tuple(box_lengths) == tuple(record.shape):  # all of a whole tensor
            index = self._index(writer)
            file_index, begin, end = self._located(index, item.name, where)
            if end - begin != target.numel():
                raise CorruptShardError(f"{where}: chunk holds {end - begin} bytes, not {target.numel()}")
            pieces.setdefault((writer, file_index), []).append(_Piece(begin, end, target))
            return
        for chunk in record.chunks.overlapping(item.box):
            common = overlap((chunk.offsets, chunk.lengths), item.box)
            assert common is not None
            index = self._index(chunk.writer)
            key = chunk_key(item.name, chunk.offsets, chunk.lengths, record.shape)
            file_index, begin, end = self._located(index, key, where)
            if end - begin != chunk.numel * itemsize:
                raise CorruptShardError(
                    f"{where}: chunk {key!r} holds {end - begin} bytes, not {chunk.numel * itemsize}"
                )
            in_chunk = (tuple(o - c for o, c in zip(common[0], chunk.offsets)), common[1])
            in_box = (tuple(o - b for o, b in zip(common[0], box_offsets)), common[1])
            source_run, source_starts = byte_runs(chunk.lengths, in_chunk, itemsize)
            target_run, target_starts = byte_runs(box_lengths, in_box, itemsize)
            run = min(source_run, target_run)  # one divides the other
            row_bytes = math.prod(chunk.lengths[1:]) * itemsize
            if (
                run < SMALL_RUN_BYTES
                and len(source_starts) * (source_run // run) > 1
                and row_bytes <= index.files[file_index].block_bytes
            ):
                self._plan_slabs(
                    item,
                    chunk.lengths,
                    in_chunk,
                    in_box,
                    begin,
                    row_bytes,
                    pieces.setdefault((chunk.writer, file_index), []),
                )
                continue
            split_source, split_target = source_run // run, target_run // run
            sources = [s + k * run for s in source_starts for k in range(split_source)]
            targets = [t + k * run for t in target_starts for k in range(split_target)]
            found = pieces.setdefault((chunk.writer, file_index), [])
            found.extend(_Piece(begin + s, begin + s + run, target[t : t + run]) for s, t in zip(sources, targets))

    def _plan_slabs(
        self,
        item: BoxRead,
        lengths: tuple[int, ...],
        in_chunk: Box,
        in_box: Box,
        begin: int,
        row_bytes: int,
        found: list[_Piece],
    ) -> None:
        """Read the rows of a chunk that hold ``in_chunk`` in slabs of up to a read unit's bytes;
        each slab's part of the box is copied into ``item.into`` (at ``in_box``) by one copy."""
        first, count = in_chunk[0][0], in_chunk[1][0]
        inner = tuple(slice(o, o + n) for o, n in zip(in_chunk[0][1:], in_chunk[1][1:]))
        inner_target = tuple(slice(o, o + n) for o, n in zip(in_box[0][1:], in_box[1][1:]))
        per_slab = max(1, CHECKSUM_CHUNK_BYTES // row_bytes)
        for row in range(first, first + count, per_slab):
            rows = min(per_slab, first + count - row)
            at = in_box[0][0] + row - first

            def copy(scratch: torch.Tensor, rows: int = rows, at: int = at) -> None:
                source = scratch.view(item.into.dtype).view((rows,) + tuple(lengths[1:]))
                item.into[(slice(at, at + rows),) + inner_target].copy_(source[(slice(None),) + inner])

            start = begin + row * row_bytes
            found.append(_Piece(start, start + rows * row_bytes, None, Slab(rows * row_bytes, copy, self._scratch)))

    @staticmethod
    def _located(index: RankIndex, key: str, where: str) -> tuple[int, int, int]:
        try:
            return index.chunks[key]
        except KeyError:
            raise CorruptShardError(f"{where}: chunk {key!r} is missing from rank {index.rank}'s index") from None

    @staticmethod
    def _blocks(block: int, file_pieces: list[_Piece]) -> list[int]:
        """The numbers of the blocks of one file that ``file_pieces`` touch, sorted (the pieces too)."""
        file_pieces.sort(key=lambda p: p.begin)
        return sorted({b for p in file_pieces for b in range(p.begin // block, (p.end - 1) // block + 1)})

    def _units(
        self, index: RankIndex, file_index: int, file_pieces: list[_Piece], blocks: list[int], unit_bytes: int
    ) -> list[tuple]:
        """Split one file's pieces (sorted) into read units: runs of whole ``blocks``, up to
        ``unit_bytes`` each (:meth:`~spotrun.storage.base.Storage.read_unit_bytes`)."""
        item = index.files[file_index]
        block = item.block_bytes
        per_unit = max(1, unit_bytes // block)
        units = []
        group: list[int] = []
        for b in blocks:
            if group and (b != group[-1] + 1 or len(group) == per_unit):
                units.append(group)
                group = []
            group.append(b)
        if group:
            units.append(group)
        result = []
        cursor = 0
        for group in units:
            start, stop = group[0] * block, min((group[-1] + 1) * block, item.size_bytes)
            inside = []
            while cursor < len(file_pieces) and file_pieces[cursor].begin < stop:
                inside.append(file_pieces[cursor])
                cursor += 1
            # a piece that runs past this unit goes on in the next one
            if inside and inside[-1].end > stop:
                last = inside[-1]
                cut = stop - last.begin
                cursor -= 1
                if last.slab is None:
                    inside[-1] = _Piece(last.begin, stop, last.target[:cut])
                    file_pieces[cursor] = _Piece(stop, last.end, last.target[cut:])
                else:
                    last.slab.pending += 1
                    inside[-1] = _Piece(last.begin, stop, None, last.slab, last.slab_offset)
                    file_pieces[cursor] = _Piece(stop, last.end, None, last.slab, last.slab_offset + cut)
            result.append((index, file_index, start, stop, inside))
        return result

    def _read_unit(self, index: RankIndex, file_index: int, start: int, stop: int, inside: list[_Piece]) -> None:
        item = index.files[file_index]
        if self._files.get(item.path) is None or self._files[item.path].size_bytes != item.size_bytes:
            raise CorruptShardError(f"{self._where(item.path)}: not in the manifest with the size its index records")
        key = self._key(item.path)
        where = f"{self._storage.uri}/{key}"
        views: list[memoryview] = []
        position = start
        for piece in inside:
            if piece.begin > position:
                views.append(memoryview(bytearray(piece.begin - position)))
            target = (
                piece.target
                if piece.slab is None
                else piece.slab.view(piece.slab_offset, piece.slab_offset + piece.end - piece.begin)
            )
            views.append(memoryview(target.numpy()))
            position = piece.end
        if position < stop:
            views.append(memoryview(bytearray(stop - position)))
        _read(self._storage, key, start, views, where)
        with self._lock:
            self.bytes_read += stop - start
            self._bar.update(stop - start)
        block = item.block_bytes
        digest = blake3.blake3()
        position = start  # start is a block boundary; stop one too, or the file's end
        for view in views:
            offset = 0
            while offset < len(view):
                block_end = (position // block + 1) * block
                take = min(len(view) - offset, block_end - position)
                digest.update(view[offset : offset + take])
                offset += take
                position += take
                if position == block_end or position == stop:
                    self._check_block(item, (position - 1) // block, digest, where)
                    digest = blake3.blake3()
        for piece in inside:  # verified: slabs whose every part is read go to their boxes
            if piece.slab is not None:
                piece.slab.part_read()

    @staticmethod
    def _check_block(item, number: int, digest, where: str) -> None:
        if digest.hexdigest() != item.block_digests[number]:
            raise CorruptShardError(
                f"{where}: block {number} (bytes {number * item.block_bytes}-"
                f"{(number + 1) * item.block_bytes}) does not match its checksum"
            )
