"""Byte sources and chunk recorders for the ``Storage.put_stream`` tests."""

from __future__ import annotations

import threading

from spotrun.storage.base import ByteSource


class BytesSource(ByteSource):
    """``data`` served on demand, recording every range read.

    Args:
        data: the object's bytes.
        fail_at: when set, a read whose range holds this offset raises ``error``
            instead (the source died in the middle of the object).
        error: what that read raises.
    """

    def __init__(self, data: bytes, *, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self._data = memoryview(data)
        self._fail_at = fail_at
        self._error = error
        self._lock = threading.Lock()
        self.reads: list[tuple[int, int]] = []

    @property
    def size_bytes(self) -> int:
        return len(self._data)

    def readinto(self, offset: int, out: memoryview) -> None:
        if self._fail_at is not None and offset <= self._fail_at < offset + len(out):
            assert self._error is not None
            raise self._error
        out[:] = self._data[offset : offset + len(out)]
        with self._lock:
            self.reads.append((offset, len(out)))


class ChunkRecorder:
    """An ``on_chunk`` callback that keeps a copy of every chunk it is shown, by offset;
    raises ``error`` for the chunk at ``fail_at`` when set."""

    def __init__(self, *, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self._fail_at = fail_at
        self._error = error
        self._lock = threading.Lock()
        self.chunks: list[tuple[int, bytes]] = []

    def __call__(self, offset: int, data: memoryview) -> None:
        if self._fail_at is not None and offset <= self._fail_at < offset + len(data):
            assert self._error is not None
            raise self._error
        with self._lock:
            self.chunks.append((offset, bytes(data)))

    def assert_covers_once(self, data: bytes, chunk_bytes: int) -> None:
        """Every chunk of ``data`` was shown exactly once, with its own bytes."""
        offsets = sorted(offset for offset, _ in self.chunks)
        assert offsets == list(range(0, len(data), chunk_bytes))
        for offset, chunk in self.chunks:
            assert chunk == data[offset : offset + chunk_bytes], f"chunk at {offset} differs"
