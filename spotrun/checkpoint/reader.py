"""Reading a shard file straight into the tensors that will hold its values, verifying it
chunk by chunk as it is read.

For a file whose manifest record carries the chunked checksum (format 3,
:mod:`spotrun.checkpoint.stream`): the header is read first (two small reads), checked
against the manifest; then each checksum chunk's byte range is read by one scatter read
(``Storage.read_into``) directly into the destination tensors' memory - the live model and
optimizer tensors where they fit, else fresh tensors - and hashed by the same thread right
after, chunks in parallel. No buffer of the whole file exists; bytes of tensors the caller
does not want go through a scratch buffer of at most one chunk.

A file that fails verification has already written into its destinations; the caller
(:func:`spotrun.checkpoint.restore.load_newest`) then loads an older step into the same tensors, or
fails the start.
"""

from __future__ import annotations

import functools
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from spotrun.checkpoint import strict_json
from spotrun.checkpoint.dtypes import dtype_from_name, refusal
from spotrun.checkpoint.manifest import STORED_AS_BYTES, FileRecord, TensorRecord
from spotrun.checkpoint.shard import SAFETENSORS_MAX_HEADER_BYTES
from spotrun.checkpoint.stream import (
    CHUNKED_BLAKE3,
    CHUNKED_SHA256,
    SAFETENSORS_CODES,
    ChunkDigests,
    byte_view,
    chunk_ranges,
    copy_bytes,
)
from spotrun.errors import CorruptShardError, ObjectTooShortError
from spotrun.storage.base import Storage

#: A chunk holding more tensors than this is read into a scratch buffer and copied from
#: there (a view per tiny tensor costs more than copying its bytes).
_SCATTER_MAX_PIECES = 16


@dataclass
class _Piece:
    """Bytes ``[start, stop)`` of the file, and where they go (``None``: scratch)."""

    start: int
    stop: int
    target: torch.Tensor | None  # 1-D uint8 view of the destination


@functools.cache
def _dtype_info(name: str) -> tuple[torch.dtype | None, str | None]:
    """(the dtype named ``name``, why it cannot be decoded or ``None``) - once per name."""
    dtype = dtype_from_name(name)
    if dtype is None:
        return None, (
            f"dtype {name!r} is not a dtype torch {torch.__version__} has, so it cannot "
            "be decoded (was the checkpoint written with a newer torch?)"
        )
    reason = refusal(dtype)
    return dtype, None if reason is None else f"dtype {name} cannot be decoded: {reason}"


def fits(tensor: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether a file's bytes can be read straight into ``tensor`` (a contiguous CPU tensor of
    ``dtype`` and ``shape``, not a conjugate or negative view)."""
    return (
        tensor.dtype == dtype
        and tensor.device.type == "cpu"
        and list(tensor.shape) == list(shape)
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _stored_form(record: TensorRecord, where: str) -> tuple[torch.dtype, str, list[int], int]:
    """The dtype of ``record``, and the safetensors dtype code, shape and byte count the file
    must hold for it (nothing is allocated: the caller checks these against the file first)."""
    dtype, problem = _dtype_info(record.dtype)
    if problem is not None:
        raise CorruptShardError(f"{where}: {problem}")
    assert dtype is not None
    nbytes = math.prod(record.shape) * dtype.itemsize
    if record.stored_as == STORED_AS_BYTES:
        return dtype, "U8", [nbytes], nbytes
    return dtype, SAFETENSORS_CODES.get(dtype, "?"), record.shape, nbytes


def _destination(record: TensorRecord, dtype: torch.dtype, given: torch.Tensor | None) -> torch.Tensor:
    """The tensor to read ``record``'s bytes into: ``given`` when it is a contiguous CPU
    tensor of the recorded dtype and shape, else a new one (sized by the manifest: call only
    once the file's header has shown that the file holds that many bytes)."""
    if given is not None and fits(given, dtype, record.shape):
        return given.detach()
    return torch.empty(record.shape, dtype=dtype)


def read_header(storage: Storage, key: str, size_bytes: int, *, where: str) -> tuple[dict, bytes]:
    """The JSON header of the safetensors file ``key`` of ``size_bytes`` (as parsed: name ->
    entry, and ``"__metadata__"``) and the file's first bytes up to its data (the 8-byte header
    length and the JSON), read with two small reads.

    Raises:
        CorruptShardError: the file is too short for a header, or its header does not fit its
            ``size_bytes``, is shorter than that, or does not parse (``where`` starts the message).
        StorageError: a read failed.
    """
    if size_bytes < 8:
        raise CorruptShardError(f"{where}: {size_bytes} bytes recorded, too few for a safetensors file")
    prefix = bytearray(8)
    _read(storage, key, 0, [memoryview(prefix)], where)
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > SAFETENSORS_MAX_HEADER_BYTES or 8 + header_bytes > size_bytes:
        raise CorruptShardError(f"{where}: header length {header_bytes} does not fit the file's {size_bytes} bytes")
    header_raw = bytearray(header_bytes)
    _read(storage, key, 8, [memoryview(header_raw)], where)
    try:
        header = strict_json.loads(header_raw, max_bytes=None, what="safetensors header")  # bounded above
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptShardError(f"{where}: the safetensors header does not parse: {exc}") from exc
    return header, bytes(prefix) + bytes(header_raw)


def read_shard_into(
    storage: Storage,
    key: str,
    record: FileRecord,
    wanted: dict[str, TensorRecord],
    destinations: dict[str, torch.Tensor],
    *,
    where: str,
) -> dict[str, torch.Tensor]:
    """Read and verify one format-3 shard file; return ``name -> tensor`` for ``wanted``.

    Args:
        key: the file's storage key.
        record: its manifest record (size, chunked digest (``blake3-chunks`` or ``sha256-chunks``), chunk size).
        wanted: name -> manifest record of each tensor to return (all in this file).
        destinations: name -> tensor to fill where it fits (contiguous, CPU, the recorded
            dtype and shape); others get new tensors.
        where: the file's URI, for messages.

    Raises:
        CorruptShardError: the header does not parse or does not match the manifest, the
            file is shorter than recorded, or a chunk's checksum differs.
        StorageError: a read failed.
    """
    size = record.size_bytes
    chunk_bytes = record.chunk_bytes or size
    header, head = read_header(storage, key, size, where=where)
    tensors, pieces = _plan_pieces(header, len(head), size, wanted, destinations, where=where)
    if record.algorithm not in (CHUNKED_BLAKE3, CHUNKED_SHA256):
        raise CorruptShardError(f"{where}: checksum algorithm {record.algorithm!r} is not a chunked one")
    digests = ChunkDigests(size, chunk_bytes, record.algorithm)
    read_chunk = _ChunkReader(storage, key, head, pieces, digests, where)
    ranges = chunk_ranges(size, chunk_bytes)
    if len(ranges) <= 1:
        for start, stop in ranges:
            read_chunk(start, stop)
    else:
        with ThreadPoolExecutor(
            max_workers=min(storage.read_concurrency, len(ranges)), thread_name_prefix="spotrun-read"
        ) as pool:
            for future in [pool.submit(read_chunk, a, b) for a, b in ranges]:
                future.result()
    if digests.hexdigest() != record.digest:
        raise CorruptShardError(f"{where}: checksum ({record.algorithm}) does not match the manifest's {record.digest}")
    return tensors


def _plan_pieces(
    header: dict,
    data_start: int,
    size: int,
    wanted: dict[str, TensorRecord],
    destinations: dict[str, torch.Tensor],
    *,
    where: str,
) -> tuple[dict[str, torch.Tensor], list[_Piece]]:
    """Check the header as ``spotrun verify`` does, then allocate (or take from
    ``destinations``) the ``wanted`` tensors; returns them and the file's data as pieces
    sorted by offset, each with its destination bytes (``None``: not wanted)."""
    # imported here: verify_tensors reads headers through this module
    from spotrun.checkpoint.verify_tensors import entry_problem, parse_header

    parsed = parse_header(header, data_start, size)
    for problem in parsed.problems:
        raise CorruptShardError(f"{where}: {problem}")
    for name, tensor_record in wanted.items():
        problem = entry_problem(parsed, name, tensor_record, tensor_record.shape, name)
        if problem is not None:
            raise CorruptShardError(f"{where}: {problem}")
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[_Piece] = []
    for name, entry in sorted(parsed.entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        target = None
        if name in wanted:
            # entry_problem above showed the file holds these bytes: only now is anything allocated
            dtype, _, _, nbytes = _stored_form(wanted[name], f"{where}: tensor {name!r}")
            tensor = _destination(wanted[name], dtype, destinations.get(name))
            tensors[name] = tensor
            target = byte_view(tensor) if nbytes else None
        if entry.end > entry.begin:
            pieces.append(_Piece(entry.begin, entry.end, target))
    return tensors, pieces


class _ChunkReader:
    """Reads one checksum chunk ``[start, stop)`` of a file into its pieces' destinations and
    hashes it (called from several threads at once, one chunk each)."""

    def __init__(
        self, storage: Storage, key: str, head: bytes, pieces: list[_Piece], digests: ChunkDigests, where: str
    ) -> None:
        self.storage, self.key, self.where = storage, key, where
        self.head = head  # the file's bytes before its data (header length and JSON), already read
        self.pieces = pieces
        self.digests = digests

    def __call__(self, start: int, stop: int) -> None:
        data_start = len(self.head)
        held: list[memoryview | bytes] = []
        if start < data_start:
            held.append(self.head[start : min(stop, data_start)])
        begin = max(start, data_start)
        overlapping = _overlapping(self.pieces, begin, stop)
        if len(overlapping) > _SCATTER_MAX_PIECES:
            self._read_via_scratch(start, begin, stop, held, overlapping)
            return
        views: list[memoryview] = []
        for piece in overlapping:
            a, b = max(start, piece.start), min(stop, piece.stop)
            if piece.target is None:
                view = memoryview(bytearray(b - a))
            else:
                view = memoryview(piece.target[a - piece.start : b - piece.start].numpy())
            views.append(view)
        if views:
            _read(self.storage, self.key, begin, views, self.where)
        self.digests.add(start, held + views)

    def _read_via_scratch(
        self, start: int, begin: int, stop: int, held: list[memoryview | bytes], overlapping: list[_Piece]
    ) -> None:
        """Many small tensors: one read into a scratch chunk, then a copy into each."""
        scratch = bytearray(stop - begin)
        _read(self.storage, self.key, begin, [memoryview(scratch)], self.where)
        self.digests.add(start, held + [memoryview(scratch)])
        source = torch.frombuffer(scratch, dtype=torch.uint8)
        for piece in overlapping:
            if piece.target is not None:
                a, b = max(begin, piece.start), min(stop, piece.stop)
                copy_bytes(piece.target[a - piece.start : b - piece.start], source[a - begin : b - begin])


def _overlapping(pieces: list[_Piece], start: int, stop: int) -> list[_Piece]:
    """The pieces that overlap ``[start, stop)`` (``pieces`` are sorted and back to back)."""
    lo, hi = 0, len(pieces)
    while lo < hi:  # first piece ending after start
        mid = (lo + hi) // 2
        if pieces[mid].stop <= start:
            lo = mid + 1
        else:
            hi = mid
    found = []
    for piece in pieces[lo:]:
        if piece.start >= stop:
            break
        found.append(piece)
    return found


def _read(storage: Storage, key: str, offset: int, views: list[memoryview], where: str) -> None:
    try:
        storage.read_into(key, offset, views)
    except ObjectTooShortError as exc:
        raise CorruptShardError(f"{where}: shorter than the manifest records ({exc})") from exc
