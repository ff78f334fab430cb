"""Writing one rank's shard files and its index into storage, hashing the bytes as they
pass; the save protocol around it (gathers, manifest) is :mod:`spotrun.checkpoint.save`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from spotrun.checkpoint.layout import data_file_key, index_name, shard_part_name
from spotrun.checkpoint.manifest import FileRecord, SpreadLayout
from spotrun.checkpoint.rank_index import IndexedFile, RankIndex
from spotrun.checkpoint.shard import sha256_hex
from spotrun.checkpoint.stream import (
    CHECKSUM_BLOCK_BYTES,
    CHECKSUM_CHUNK_BYTES,
    CHUNKED_BLAKE3,
    ChunkDigests,
    ShardSource,
)
from spotrun.errors import SaveAbortedError
from spotrun.storage.base import Storage
from spotrun.tools.gc_pause import gc_paused

if TYPE_CHECKING:
    from spotrun.checkpoint.save import PreparedSave


class SaveProgress:
    """Bytes written so far by this rank's part of a save (read by another thread to
    estimate when a save in flight will commit); ``on_add(nbytes)`` is also called at each add.

    Attributes:
        bytes_total: bytes this rank writes (0 until known).
        bytes_done: bytes written so far.
        started_monotonic_s: when the write began (``time.monotonic``), ``None`` before.
    """

    def __init__(self, on_add: Callable[[int], object] | None = None) -> None:
        self.bytes_total = 0
        self.bytes_done = 0
        self.started_monotonic_s: float | None = None
        self._on_add = on_add
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_done += nbytes
            if self._on_add is not None:
                self._on_add(nbytes)

    def remaining_s(self) -> float | None:
        """Seconds the rest of the write should take at the rate seen so far; ``None``
        before any byte was written."""
        if self.started_monotonic_s is None or self.bytes_done <= 0:
            return None
        elapsed_s = time.monotonic() - self.started_monotonic_s
        return max(0.0, (self.bytes_total - self.bytes_done) * elapsed_s / self.bytes_done)


def write_shard(
    storage: Storage,
    prepared: PreparedSave,
    incarnation: int,
    parts: list[list[str]],
    layout: SpreadLayout | None = None,
    *,
    abort: threading.Event | None = None,
    progress: SaveProgress | None = None,
) -> tuple[list[FileRecord], RankIndex]:
    """Stream this rank's shard into storage, one file per part, one file at a time.

    Each file's bytes go from the tensors' memory through the backend's bounded buffer
    (:meth:`~spotrun.storage.base.Storage.put_stream`), hashed block by block
    (:data:`~spotrun.checkpoint.stream.CHECKSUM_BLOCK_BYTES`) as they pass.

    Args:
        parts: chunk keys of ``prepared.tensors``, one list per file
            (:func:`~spotrun.checkpoint.shard.split_into_parts`).
        layout: the step's key layout (``None``: the step directory).
        abort: when set, the write stops at the next chunk (:class:`SaveAbortedError`).
        progress: updated as bytes are written.

    Returns:
        The manifest records of the files, in the order of ``parts``, and this rank's index
        (where each chunk lies, each block's digest), not yet written.
    """
    records = []
    indexed: list[IndexedFile] = []
    located: dict[str, tuple[int, int, int]] = {}
    for part, names in enumerate(parts):
        if abort is not None and abort.is_set():
            raise SaveAbortedError(f"save of step {prepared.step} abandoned")
        path, source = shard_file(prepared.step, prepared.rank, incarnation, part, prepared.tensors, names, abort=abort)
        digests = ChunkDigests(source.size_bytes, CHECKSUM_BLOCK_BYTES)

        def on_chunk(offset: int, data: memoryview, digests: ChunkDigests = digests) -> None:
            digests.add_span(offset, data)
            if progress is not None:
                progress.add(len(data))

        storage.put_stream(
            data_file_key(prepared.step, prepared.rank, path, layout),
            source,
            chunk_bytes=CHECKSUM_CHUNK_BYTES,
            on_chunk=on_chunk,
        )
        records.append(
            FileRecord(
                path=path,
                rank=prepared.rank,
                size_bytes=source.size_bytes,
                digest=digests.hexdigest(),
                algorithm=CHUNKED_BLAKE3,
                chunk_bytes=CHECKSUM_BLOCK_BYTES,
            )
        )
        entry, where = index_entry(part, path, source, digests.chunk_hexdigests())
        indexed.append(entry)
        located.update(where)
    return records, RankIndex(step=prepared.step, rank=prepared.rank, files=indexed, chunks=located)


def shard_file(
    step: int,
    rank: int,
    incarnation: int,
    part: int,
    tensors: dict[str, torch.Tensor],
    names: list[str],
    *,
    abort: threading.Event | None = None,
) -> tuple[str, ShardSource]:
    """The path (relative to the step) and the bytes of file ``part`` of ``rank``'s shard, which
    holds ``names`` of ``tensors`` (in stored form)."""
    with gc_paused():
        source = ShardSource(
            {n: tensors[n] for n in names},
            {"format": "spotrun-checkpoint", "step": step, "rank": rank, "part": part},
            abort=abort,
        )
    return shard_part_name(rank, incarnation, part), source


def index_entry(
    part: int, path: str, source: ShardSource, block_digests: list[str]
) -> tuple[IndexedFile, dict[str, tuple[int, int, int]]]:
    """A shard file's entry in its rank's index, and where each of its chunks lies
    (chunk key -> (part, begin, end))."""
    entry = IndexedFile(
        path=path, size_bytes=source.size_bytes, block_bytes=CHECKSUM_BLOCK_BYTES, block_digests=block_digests
    )
    return entry, {n: (part, begin, end) for n, (begin, end) in source.ranges.items()}


def write_index(storage: Storage, index: RankIndex, incarnation: int, layout: SpreadLayout | None = None) -> FileRecord:
    """Write a rank's index (after its shard files, where ``layout`` puts them) and return its
    manifest record."""
    data = index.to_json()
    path = index_name(index.rank, incarnation)
    storage.put(data_file_key(index.step, index.rank, path, layout), data)
    return FileRecord(path=path, rank=index.rank, size_bytes=len(data), digest=sha256_hex(data))
