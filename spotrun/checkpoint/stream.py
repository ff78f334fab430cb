"""Writing a shard file as a stream: the safetensors header computed up front, the tensors'
bytes copied out of their own memory chunk by chunk, a checksum built while they pass.

Nothing builds the file in memory: :class:`ShardSource` serves any byte range of it straight
from the tensors, and a storage backend pulls ranges into its own bounded buffer. The checksum
(:data:`CHUNKED_BLAKE3`) is the BLAKE3 of the BLAKE3 digests of the file's chunks, so writers and
readers hash chunks in parallel. Why BLAKE3, and the older checksums still verified:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import struct
import threading
from collections.abc import Sequence

import blake3
import torch

from spotrun.errors import SaveAbortedError, StateSerializationError
from spotrun.storage.base import ByteSource

#: ``FileRecord.algorithm`` of the chunked checksum written since format 3.
CHUNKED_BLAKE3 = "blake3-chunks"
#: ``FileRecord.algorithm`` of the same construction with SHA-256 (read, not written).
CHUNKED_SHA256 = "sha256-chunks"
_HASHES = {CHUNKED_BLAKE3: blake3.blake3, CHUNKED_SHA256: hashlib.sha256}
#: ``FileRecord.algorithm`` of a whole-file SHA-256 (formats 1 and 2).
WHOLE_SHA256 = "sha256"
#: Bytes of one checksum chunk (and of one local write) in format 3.
CHECKSUM_CHUNK_BYTES = 8 * 2**20
#: Bytes of one checksum block in format 4: a restore that reads part of a file (another
#: layout's share of a chunk) verifies whole blocks, so it reads at most this much more on
#: each side of every byte range it needs. Writes still go in chunks of CHECKSUM_CHUNK_BYTES.
CHECKSUM_BLOCK_BYTES = 2**20
#: The JSON header is padded with spaces so that the tensors' bytes start at a multiple of this.
DATA_ALIGNMENT_BYTES = 64

#: safetensors' code of each dtype it stores natively (see :mod:`spotrun.checkpoint.dtypes`).
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_CODES[getattr(torch, _name)] = _code


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D ``uint8`` tensor sharing its memory."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination.copy_(source)`` for two 1-D ``uint8`` tensors of equal length.

    Between host tensors this is one ``memmove`` on the calling thread, with the GIL
    released: the threads that fill a file's chunks then copy side by side. torch's own
    ``copy_`` splits a large copy over its intra-op threads, which on a busy machine wait
    for each other (measured here: 4x slower than one thread at 768 MiB). Copies from or
    to a GPU go through ``copy_``.
    """
    if destination.device.type == "cpu" and source.device.type == "cpu":
        if destination.numel():
            ctypes.memmove(destination.data_ptr(), source.data_ptr(), destination.numel())
    else:
        destination.copy_(source)


class ShardSource(ByteSource):
    """One shard file's bytes, served from its tensors' memory.

    Args:
        tensors: name -> tensor in stored form (a dtype safetensors stores natively; any
            device; a non-contiguous tensor is made contiguous here, a copy of that tensor).
            Nothing may change them until the file is written.
        metadata: the header's ``__metadata__`` (values converted with ``str``).
        abort: when set, :meth:`readinto` raises :class:`SaveAbortedError` (the save was
            abandoned); checked once per call.

    Raises:
        StateSerializationError: a metadata key is not a string, or a tensor's dtype has no
            safetensors code.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], metadata: dict[str, object], *, abort: threading.Event | None = None
    ) -> None:
        header: dict[str, object] = {}
        meta: dict[str, str] = {}
        for key, value in metadata.items():
            if not isinstance(key, str):
                raise StateSerializationError(f"safetensors metadata key {key!r} is not a string")
            meta[key] = value if isinstance(value, str) else str(value)
        if meta:
            header["__metadata__"] = meta
        self._bytes: list[torch.Tensor] = []
        self.ranges: dict[str, tuple[int, int]] = {}  # name -> its bytes [begin, end) in the file
        starts: list[int] = []
        offset = 0
        for name, tensor in tensors.items():
            code = SAFETENSORS_CODES.get(tensor.dtype)
            if code is None:
                raise StateSerializationError(f"tensor {name!r}: safetensors has no code for {tensor.dtype}")
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
            if nbytes:
                starts.append(offset)
                self._bytes.append(byte_view(tensor))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        padded = -(-(8 + len(text)) // DATA_ALIGNMENT_BYTES) * DATA_ALIGNMENT_BYTES - 8
        self.header = struct.pack("<Q", padded) + text + b" " * (padded - len(text))
        self._data_start = len(self.header)
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]  # type: ignore[index]
                self.ranges[name] = (self._data_start + begin, self._data_start + end)
        self._starts = [self._data_start + s for s in starts]
        self._size_bytes = self._data_start + offset
        self._abort = abort

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def readinto(self, offset: int, out: memoryview) -> None:
        if self._abort is not None and self._abort.is_set():
            raise SaveAbortedError("save abandoned")
        end = offset + len(out)
        if offset < 0 or end > self._size_bytes:
            raise ValueError(f"range {offset}-{end} is outside the file's {self._size_bytes} bytes")
        position = offset
        if position < self._data_start:
            piece = min(end, self._data_start) - position
            out[:piece] = self.header[position : position + piece]
            position += piece
        if position >= end:
            return
        target = torch.frombuffer(out, dtype=torch.uint8)
        index = bisect.bisect_right(self._starts, position) - 1
        while position < end:
            start = self._starts[index]
            source = self._bytes[index]
            take = min(end, start + source.numel()) - position
            copy_bytes(
                target[position - offset : position - offset + take], source[position - start : position - start + take]
            )
            position += take
            index += 1


class ChunkDigests:
    """Collects the digest of each chunk of one file (``on_chunk`` of a put) and gives the
    file's digest (``algorithm``: :data:`CHUNKED_BLAKE3` or :data:`CHUNKED_SHA256`).
    Thread-safe.

    Raises:
        ValueError: an unknown algorithm.
    """

    def __init__(self, size_bytes: int, chunk_bytes: int, algorithm: str = CHUNKED_BLAKE3) -> None:
        if algorithm not in _HASHES:
            raise ValueError(f"unknown chunked checksum {algorithm!r}; known: {sorted(_HASHES)}")
        self.size_bytes = size_bytes
        self.chunk_bytes = chunk_bytes
        self.algorithm = algorithm
        self._hash = _HASHES[algorithm]
        self._digests: dict[int, bytes] = {}

    def __call__(self, offset: int, data: memoryview) -> None:
        self.add(offset, [data])

    def add(self, offset: int, pieces: Sequence[memoryview | bytes]) -> None:
        """Record the chunk starting at ``offset`` whose bytes are ``pieces`` in order."""
        if offset % self.chunk_bytes:
            raise ValueError(f"chunk offset {offset} is not a multiple of {self.chunk_bytes}")
        digest = self._hash()
        for piece in pieces:
            digest.update(piece)
        self._digests[offset // self.chunk_bytes] = digest.digest()

    def add_span(self, offset: int, data: memoryview) -> None:
        """Record every chunk of ``data``, which starts at ``offset`` (a multiple of
        ``chunk_bytes``) and spans whole chunks (but for the file's last)."""
        for start in range(0, len(data), self.chunk_bytes):
            self.add(offset + start, [data[start : start + self.chunk_bytes]])

    def _in_order(self) -> list[bytes]:
        count = -(-self.size_bytes // self.chunk_bytes)
        missing = [i for i in range(count) if i not in self._digests]
        if missing:
            raise ValueError(f"chunks {missing[:5]} of {count} were never hashed")
        return [self._digests[i] for i in range(count)]

    def chunk_hexdigests(self) -> list[str]:
        """Each chunk's digest in order (hex).

        Raises:
            ValueError: a chunk was never recorded.
        """
        return [d.hex() for d in self._in_order()]

    def hexdigest(self) -> str:
        """The file's digest.

        Raises:
            ValueError: a chunk was never recorded.
        """
        return self._hash(b"".join(self._in_order())).hexdigest()


def chunk_ranges(size_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of every checksum chunk of a file of ``size_bytes``."""
    return [(start, min(start + chunk_bytes, size_bytes)) for start in range(0, size_bytes, chunk_bytes)]
