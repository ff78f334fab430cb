"""What the object stores' parallel transfers share: byte ranges of parts, a part runner that
stops at the first failure, reused part buffers, and views over the caller's buffers.

No client library here: the S3, GCS and Azure backends each drive their own requests with these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from spotrun.storage.base import ByteSource, ChunkCallback


def part_ranges(size_bytes: int, part_size_bytes: int) -> list[tuple[int, int]]:
    """Split ``[0, size_bytes)`` into ``(start, stop)`` byte ranges of ``part_size_bytes``.

    The last range holds the remainder; an empty object gives no ranges.
    """
    return [(start, min(start + part_size_bytes, size_bytes)) for start in range(0, size_bytes, part_size_bytes)]


class MemorySource(ByteSource):
    """A :class:`~spotrun.storage.base.ByteSource` over bytes already in memory.

    Args:
        data: the object's bytes (any contiguous byte view); not copied.
    """

    def __init__(self, data: memoryview) -> None:
        self._data = memoryview(data).cast("B")

    @property
    def size_bytes(self) -> int:
        return len(self._data)

    def readinto(self, offset: int, out: memoryview) -> None:
        out[:] = self._data[offset : offset + len(out)]


class _Skipped(Exception):
    """A part not started because another part had already failed."""


def run_parts(executor: ThreadPoolExecutor, tasks: list[Callable[[], Any]]) -> list[Any]:
    """Run ``tasks`` on ``executor``; on the first failure start no more and re-raise it.

    Parts already running are waited for before the exception leaves, so that nothing
    is still writing when the caller cleans up.
    """
    failed = threading.Event()

    def guarded(task: Callable[[], Any]) -> Any:
        if failed.is_set():
            raise _Skipped
        try:
            return task()
        except BaseException:
            failed.set()
            raise

    futures: list[Future] = [executor.submit(guarded, task) for task in tasks]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        if failed.is_set():
            for future in futures:
                future.cancel()
            wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            raise next(e for e in errors if not isinstance(e, _Skipped))
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)
        raise


def fill_buffer(
    source: ByteSource,
    buffer: bytearray,
    offset: int,
    chunk_bytes: int,
    on_chunk: ChunkCallback | None,
) -> None:
    """Read bytes ``[offset, offset + len(buffer))`` of ``source`` into ``buffer``, chunk by
    chunk (chunks start at multiples of ``chunk_bytes`` when ``offset`` does), passing each
    chunk, read-only, to ``on_chunk`` right after it is read."""
    view = memoryview(buffer)
    for start in range(0, len(buffer), chunk_bytes):
        piece = view[start : start + chunk_bytes]
        source.readinto(offset + start, piece)
        if on_chunk is not None:
            on_chunk(offset + start, piece.toreadonly())


class PartBuffers:
    """Full-size part buffers, reused; a buffer is taken by one part's thread at a time, so
    no more exist than parts run at once. The last, shorter part gets a buffer of its own
    size and a free full-size buffer, if any, is dropped for it (so the count stays bounded).
    """

    def __init__(self, part_size_bytes: int) -> None:
        self._part_size_bytes = part_size_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size_bytes: int) -> bytearray:
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None or size_bytes != len(buffer):
            return bytearray(size_bytes)
        return buffer

    def give(self, buffer: bytearray) -> None:
        if len(buffer) == self._part_size_bytes:
            with self._lock:
                self._free.append(buffer)


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The parts of ``views`` (taken as one range, in order) that cover ``[start, stop)``."""
    out: list[memoryview] = []
    base = 0
    for view in views:
        end = base + len(view)
        if end > start and base < stop:
            out.append(view[max(start, base) - base : min(stop, end) - base])
        base = end
    return out


class ViewWriter:
    """A file-like ``write`` target that fills a list of views in order (a ranged download into
    the caller's buffers, for a client library that writes to a file object); ``written`` counts
    the bytes. More bytes than the views hold is an error, not a silent overrun."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [v for v in views if len(v)]
        self._index = 0
        self._position = 0
        self.written = 0

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        done = 0
        while done < len(data):
            if self._index >= len(self._views):
                raise OverflowError("the server sent more bytes than the range asked for")
            view = self._views[self._index]
            count = min(len(view) - self._position, len(data) - done)
            view[self._position : self._position + count] = data[done : done + count]
            done += count
            self._position += count
            if self._position == len(view):
                self._index += 1
                self._position = 0
        self.written += done
        return done
