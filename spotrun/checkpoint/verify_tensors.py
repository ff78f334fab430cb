"""The tensor half of ``spotrun verify``: is every tensor the manifest lists in its file, with
the recorded dtype, shape and bytes?

Only safetensors headers are read here (the bytes are checked by their digests,
:mod:`spotrun.checkpoint.verify`); restores check each file or chunk they read with the same
functions (:func:`parse_header`, :func:`entry_problem`). The checks per format:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spotrun.checkpoint import reader
from spotrun.checkpoint.chunks import Chunk, overlap
from spotrun.checkpoint.manifest import STORED_AS_BYTES, Manifest, TensorRecord
from spotrun.checkpoint.rank_index import RankIndex, chunk_key
from spotrun.checkpoint.stream import SAFETENSORS_CODES
from spotrun.errors import CorruptShardError
from spotrun.storage.base import Storage

#: (file path or ``None`` for the step as a whole, reason): one problem found.
Finding = tuple[str | None, str]


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header: dtype code, shape, and its bytes ``[begin, end)``
    in the file (absolute offsets)."""

    code: str
    shape: list[int]
    begin: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    """A parsed safetensors header.

    Attributes:
        data_start: the file offset where the tensors' bytes begin (8 + header length).
        entries: tensor name -> :class:`Entry` (valid entries only).
        problems: what is wrong with the header itself (bad entries, gaps, overlaps).
    """

    data_start: int
    entries: dict[str, Entry]
    problems: list[str]


def read_header(storage: Storage, key: str, size_bytes: int, recorded_bytes: int) -> ShardHeader:
    """Read and parse the safetensors header of ``key`` (two reads: 8 bytes, then the JSON).

    Args:
        size_bytes: the file's size as listed.
        recorded_bytes: its size in the manifest; the entries must end exactly there when
            the two agree (a file of the wrong size is reported by its size already).

    Raises:
        CorruptShardError: the header does not fit the file or does not parse (the message is
            the reason alone, without the file's name).
        ObjectNotFoundError, StorageError: the reads failed.
    """
    try:
        header, head = reader.read_header(storage, key, size_bytes, where=key)
    except CorruptShardError as exc:
        raise CorruptShardError(str(exc).removeprefix(f"{key}: ")) from exc
    return parse_header(header, len(head), recorded_bytes if size_bytes == recorded_bytes else None)


def parse_header(header: dict, data_start: int, end_bytes: int | None) -> ShardHeader:
    """A safetensors header as parsed from JSON (:func:`spotrun.checkpoint.reader.read_header`),
    whose data starts at file offset ``data_start``; its entries must lie back to back from
    there to ``end_bytes`` (``None``: unchecked), else :attr:`ShardHeader.problems` says why."""
    entries: dict[str, Entry] = {}
    problems: list[str] = []
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        offsets = raw.get("data_offsets") if isinstance(raw, dict) else None
        shape = raw.get("shape") if isinstance(raw, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
            and isinstance(raw.get("dtype"), str)
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            problems.append(f"tensor {name} has no valid dtype, shape and data_offsets in the header")
            continue
        entries[name] = Entry(raw["dtype"], shape, data_start + offsets[0], data_start + offsets[1])
    covered = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != covered:
            problems.append(
                f"tensor {name} starts at byte {entry.begin}, not at {covered} where the one before it ends"
            )
        covered = max(covered, entry.end)
    if end_bytes is not None and covered != end_bytes and not problems:
        problems.append(f"the header describes {covered} bytes, the manifest records {end_bytes}")
    return ShardHeader(data_start, entries, problems)


def _stored_form(record: TensorRecord, lengths: list[int] | tuple[int, ...], name: str) -> tuple[str, list[int], int]:
    """The safetensors dtype code, shape and byte count a file holds for ``lengths`` elements
    of ``record``'s tensor.

    Raises:
        CorruptShardError: a dtype this torch lacks or cannot decode.
    """
    dtype, problem = reader._dtype_info(record.dtype)
    if problem is not None:
        raise CorruptShardError(f"tensor {name}: {problem}")
    assert dtype is not None
    nbytes = math.prod(lengths) * dtype.itemsize
    if record.stored_as == STORED_AS_BYTES:
        return "U8", [nbytes], nbytes
    return SAFETENSORS_CODES.get(dtype, "?"), list(lengths), nbytes


def _mismatch(entry: Entry, key: str, code: str, shape: list[int], nbytes: int, record: TensorRecord) -> str | None:
    if entry.code == code and entry.shape == shape and entry.end - entry.begin == nbytes:
        return None
    wanted = f"{record.dtype}{shape}" if record.stored_as != STORED_AS_BYTES else f"{record.dtype} as {code}{shape}"
    return (
        f"tensor {key} is stored as {entry.code}{entry.shape} ({entry.end - entry.begin} bytes); "
        f"the manifest says {wanted} ({nbytes} bytes)"
    )


def entry_problem(
    header: ShardHeader, key: str, record: TensorRecord, lengths: list[int] | tuple[int, ...], name: str
) -> str | None:
    """Why ``header`` does not hold ``lengths`` elements of tensor ``name`` (its manifest
    ``record``) under ``key`` with the dtype code, shape and byte count the record makes it
    store (the whole tensor in formats 1-3, one chunk in format 4), or ``None``."""
    try:
        code, shape, nbytes = _stored_form(record, lengths, name)
    except CorruptShardError as exc:
        return str(exc)
    entry = header.entries.get(key)
    if entry is None:
        return f"tensor {key} missing from the file"
    return _mismatch(entry, key, code, shape, nbytes, record)


def check_whole_tensors(manifest: Manifest, headers: dict[str, ShardHeader]) -> Iterator[Finding]:
    """Formats 1-3: every tensor record against its file's header (files without a readable
    header, already reported, are skipped)."""
    for name, record in manifest.tensors.items():
        header = headers.get(record.file or "")
        if header is None:
            continue
        problem = entry_problem(header, name, record, record.shape, name)
        if problem is not None:
            yield record.file, problem


def check_chunks(
    manifest: Manifest, indexes: dict[int, tuple[str, RankIndex | None]], headers: dict[str, ShardHeader]
) -> Iterator[Finding]:
    """Format 4: every tensor's chunk layout (:func:`coverage_problem`), and every chunk
    against its writer's index and its file's header (:func:`check_chunk`).

    Args:
        indexes: writer rank -> (its index file's path, the parsed index, or ``None`` when the
            index is missing or broken: already reported, its chunks are skipped).
        headers: data file path -> its header (files without one are skipped).
    """
    unindexed: set[int] = set()
    for name, record in manifest.tensors.items():
        if record.chunks is None:
            yield None, f"tensor {name} has no chunk layout in a format-{manifest.format_version} manifest"
            continue
        problem = coverage_problem(name, record)
        if problem is not None:
            yield None, problem
        for chunk in record.chunks.chunks():
            if chunk.writer not in indexes:
                if chunk.writer not in unindexed:
                    unindexed.add(chunk.writer)
                    yield None, f"the manifest lists no index of rank {chunk.writer}, which wrote chunks"
                continue
            index_path, index = indexes[chunk.writer]
            if index is not None:
                found = check_chunk(name, record, chunk, index_path, index, headers.get)
                if found is not None:
                    yield found


def check_chunk(
    name: str,
    record: TensorRecord,
    chunk: Chunk,
    index_path: str,
    index: RankIndex,
    header_of: Callable[[str], ShardHeader | None],
) -> Finding | None:
    """One chunk of tensor ``name`` against its writer's ``index`` (whose file is
    ``index_path``) and the header of the file the index puts it in: the key is in the index,
    and in that file's header with the chunk's dtype code, lengths and byte count, at exactly
    the bytes the index says (so inside the file's data, never in its header).

    Args:
        header_of: data file path -> its header (``None``: not read, the chunk is not checked
            against it).
    """
    key = chunk_key(name, chunk.offsets, chunk.lengths, record.shape)
    located = index.chunks.get(key)
    if located is None:
        return index_path, f"chunk {key} missing from rank {chunk.writer}'s index"
    file_index, begin, end = located
    path = index.files[file_index].path
    header = header_of(path)
    if header is None:
        return None
    problem = entry_problem(header, key, record, chunk.lengths, name)
    entry = header.entries.get(key)
    if problem is None and entry is not None and (entry.begin, entry.end) != (begin, end):
        problem = (
            f"tensor {key} lies at bytes {entry.begin}-{entry.end}; rank {chunk.writer}'s index says {begin}-{end}"
        )
    return None if problem is None else (path, problem)


def coverage_problem(name: str, record: TensorRecord) -> str | None:
    """Why the chunks of tensor ``name`` do not cover its global shape exactly once (a gap
    leaves part of it unread, keeping whatever the live tensor held; an overlap is read twice,
    in no set order), or ``None``. A grid covers it by construction; an explicit list is
    swept in order of its first offsets, each chunk compared with the ones it may overlap."""
    layout = record.chunks
    if layout is None or layout.grid is not None:
        return None
    chunks = sorted((c for c in layout.chunks() if c.numel), key=lambda c: c.offsets)
    active: list[Chunk] = []
    for chunk in chunks:
        if chunk.offsets:  # chunks that end before this one starts (dimension 0) overlap nothing after it
            active = [a for a in active if a.offsets[0] + a.lengths[0] > chunk.offsets[0]]
        for other in active:
            if overlap((other.offsets, other.lengths), (chunk.offsets, chunk.lengths)) is not None:
                return f"tensor {name}: its chunks at offsets {list(other.offsets)} and {list(chunk.offsets)} overlap"
        active.append(chunk)
    covered, total = sum(c.numel for c in chunks), math.prod(record.shape)
    if covered != total:
        return f"tensor {name}: its chunks cover {covered} of its {total} elements"
    return None
