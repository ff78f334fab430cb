"""The one storage interface every checkpoint backend implements.

Keys are ``/``-separated strings relative to the backend's root URI (``step-000000100/
manifest.json``); they are never ``pathlib.Path`` objects, because a ``Path`` collapses
the double slash of ``s3://``. Public methods validate the key and then call a small
``_hook`` that each backend fills in.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from spotrun.errors import ConfigError, ObjectTooShortError


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object.

    Attributes:
        key: key relative to the root, ``/``-separated.
        size_bytes: object size in bytes.
        mtime_s: last modification, seconds since the Unix epoch (UTC).
        refused: ``None`` for an object; else why the backend will not open what is there
            (local: a symbolic link, a FIFO; :mod:`spotrun.storage.local_beneath`), whose
            ``key`` may then be a directory on the way to the prefix listed. Its step is corrupt.
    """

    key: str
    size_bytes: int
    mtime_s: float
    refused: str | None = None


@dataclass(frozen=True)
class UnfinishedUpload:
    """A write that started and never finished (an S3 multipart upload never completed or
    aborted; a local temporary file never renamed onto its key).

    Attributes:
        key: the key it was writing (S3), or the temporary file's own key (local).
        time_unix_s: S3: when the upload was initiated (``Initiated``, the store's clock);
            local: the temporary file's last modification. Seconds since the Unix epoch (UTC).
        upload_id: S3's ``UploadId``; ``None`` for a local temporary file.
    """

    key: str
    time_unix_s: float
    upload_id: str | None = None


class ByteSource(abc.ABC):
    """An object's bytes, produced on demand, for :meth:`Storage.put_stream`.

    A checkpoint shard is a header followed by tensors' bytes: a source copies the
    requested range out of them, so the object is never built whole in memory.
    """

    @property
    @abc.abstractmethod
    def size_bytes(self) -> int:
        """The object's size in bytes."""

    @abc.abstractmethod
    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a writable byte view) with bytes ``[offset, offset + len(out))``.

        Thread-safe: backends call it for different ranges from several threads at once.

        Raises:
            SaveAbortedError: the save this source belongs to was abandoned.
        """


#: ``on_chunk(offset, data)``: called by :meth:`Storage.put_stream` for every chunk.
ChunkCallback = Callable[[int, memoryview], None]


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or key.endswith("/"):
        raise ConfigError(f"storage key {key!r} must be a non-empty relative path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"storage key {key!r} has an empty, '.' or '..' component")
    return key


def _check_prefix(prefix: str) -> str:
    if prefix.startswith("/") or ".." in prefix.split("/"):
        raise ConfigError(f"storage prefix {prefix!r} must be relative and stay under the root")
    return prefix


class Storage(abc.ABC):
    """A flat key -> bytes store under one root URI.

    Contract (checked by ``tests/unit/storage/test_storage_contract.py`` against every backend):
      * ``put`` is atomic: a reader sees the whole new object or nothing (no partial object
        is ever visible under the key, even when the writer dies in the middle).
      * ``put_if_absent`` never overwrites: when the key exists it raises
        :class:`~spotrun.errors.ObjectExistsError`; of two racing writers exactly one wins.
      * ``get`` of a missing key raises :class:`~spotrun.errors.ObjectNotFoundError`.
      * ``list`` returns every object whose key starts with ``prefix``, sorted by key.
      * ``delete`` of a missing key is not an error.
    """

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The root URI (``/abs/path`` or ``s3://bucket/prefix``)."""

    @property
    def commit_primitive(self) -> str | None:
        """How ``put_if_absent`` keeps its promise here, in words (``"hard link"``,
        ``"conditional PutObject (If-None-Match: *)"``), for messages; ``None`` while
        unknown (a backend that decides on first use)."""
        return None

    #: What ``put_if_absent`` needs of the store, in words, and what to do where the store
    #: ignores it: the preflight's message (:mod:`spotrun.supervisor.preflight`) names both.
    commit_requirement: ClassVar[str] = "a no-overwrite write"
    commit_advice: ClassVar[str] = "use a store that enforces it"
    #: What :meth:`unfinished_uploads` lists here, in words (``spotrun gc``'s lines).
    unfinished_upload_kind: ClassVar[str] = "unfinished write"

    @property
    def read_concurrency(self) -> int:
        """How many ``read_into`` calls a reader should keep in flight on this backend."""
        return 4

    def read_unit_bytes(self, total_bytes: int, floor_bytes: int) -> int:
        """Bytes per ``read_into`` call of a reader that reads ``total_bytes`` in units of its own,
        :attr:`read_concurrency` at once: a multiple of ``floor_bytes``. Default: ``floor_bytes``
        (a file read costs no request; object stores grow the unit with the read)."""
        return floor_bytes

    def spreads_rank_keys(self, world_size: int) -> bool:
        """Whether a checkpoint that ``world_size`` ranks save here puts each rank's files under a
        key prefix of their own (:mod:`spotrun.checkpoint.layout`): the object stores'
        ``key_layout`` option. Default: no (local directories, the fast tier)."""
        return False

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        """Bound the operations this thread starts inside the block to ``timeout_s`` seconds.

        A backend that retries (S3) stops retrying before the deadline and raises
        :class:`~spotrun.errors.StorageError`; the default does nothing, for backends
        whose operations do not retry (local files). Callers use it whatever the backend.
        """
        yield

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any old object, atomically.

        Raises:
            StorageError: the write failed; nothing is visible under ``key``.
        """
        self._put(_check_key(key), memoryview(data).cast("B"))

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` only if nothing is there yet (the commit primitive).

        Raises:
            ObjectExistsError: the key already exists; the stored object is unchanged.
            StorageError: the write failed.
        """
        self._put_if_absent(_check_key(key), memoryview(data).cast("B"))

    def put_stream(
        self, key: str, source: ByteSource, *, chunk_bytes: int, on_chunk: ChunkCallback | None = None
    ) -> None:
        """Store ``source``'s bytes under ``key``, replacing any old object, atomically (as
        :meth:`put`), holding a bounded buffer rather than the object in memory.

        Args:
            chunk_bytes: the bytes are read from ``source`` in chunks that start at multiples
                of this (the last may be shorter); backends whose transfer unit differs
                (S3 parts) keep their units multiples of it or split them at its multiples.
            on_chunk: called once with ``(offset, bytes)`` of every chunk of the object that
                ends up stored, before the call returns; possibly from several threads and
                in any order (a retried S3 part may call it again with the same bytes).
                A checksum of the object is built from it while the bytes are in cache.

        Raises:
            StorageError: the write failed; nothing is visible under ``key``.
            Whatever ``source.readinto`` or ``on_chunk`` raise (the write is abandoned).
        """
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self._put_stream(_check_key(key), source, chunk_bytes, on_chunk)

    def read_into(self, key: str, offset: int, views: Sequence[memoryview]) -> None:
        """Read bytes ``[offset, offset + total)`` of the object into ``views`` in order
        (scatter: ``total`` is the sum of their lengths), with no whole-object buffer.

        Raises:
            ObjectNotFoundError: no such key.
            ObjectTooShortError: the object ends before the range does.
            StorageError: the read failed.
        """
        self._read_into(_check_key(key), offset, [memoryview(v).cast("B") for v in views])

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such key.
            StorageError: the read failed.
        """
        return self._get(_check_key(key))

    def stat(self, key: str) -> ObjectInfo:
        """Size and time of one object; raises :class:`ObjectNotFoundError` if missing."""
        return self._stat(_check_key(key))

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        from spotrun.errors import ObjectNotFoundError

        try:
            self.stat(key)
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix``, sorted by key (recursive)."""
        return sorted(self._list(_check_prefix(prefix)), key=lambda info: info.key)

    def delete(self, key: str) -> None:
        """Remove one object; a missing key is not an error."""
        self._delete(_check_key(key))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix`` (must end with ``/``); returns how many."""
        if not prefix.endswith("/"):
            raise ConfigError(f"delete_prefix needs a prefix ending in '/', got {prefix!r}")
        infos = self.list(prefix)
        for info in infos:
            self._delete(info.key)
        return len(infos)

    def unfinished_uploads(self, prefix: str = "") -> list[UnfinishedUpload]:
        """Writes under ``prefix`` that started and never finished, sorted by key. A writer
        that is still running has its write listed too: the caller decides by age.

        Raises:
            StorageError: the listing failed.
        """
        return sorted(self._unfinished_uploads(_check_prefix(prefix)), key=lambda u: u.key)

    def abort_upload(self, upload: UnfinishedUpload) -> None:
        """Discard an unfinished write (its parts or its temporary file); one already gone
        is not an error.

        Raises:
            StorageError: the store refused or failed.
        """
        self._abort_upload(upload)

    # --- hooks for backends ---------------------------------------------------

    def _unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Default: none (a backend whose writes leave nothing behind)."""
        return []

    def _abort_upload(self, upload: UnfinishedUpload) -> None:
        """Default: nothing to discard."""

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        """Default: build the object in memory, then :meth:`_put` (backends override)."""
        data = bytearray(source.size_bytes)
        view = memoryview(data)
        for start in range(0, len(data), chunk_bytes):
            chunk = view[start : start + chunk_bytes]
            source.readinto(start, chunk)
            if on_chunk is not None:
                on_chunk(start, chunk)
        self._put(key, view)

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        """Default: :meth:`_get` the whole object, then copy the range (backends override)."""
        data = memoryview(self._get(key))
        total = sum(len(v) for v in views)
        if offset < 0 or offset + total > len(data):
            raise ObjectTooShortError(
                5, f"read of {key}: bytes {offset}-{offset + total} are past its end ({len(data)})"
            )
        for view in views:
            view[:] = data[offset : offset + len(view)]
            offset += len(view)

    @abc.abstractmethod
    def _put(self, key: str, data: memoryview) -> None: ...

    @abc.abstractmethod
    def _put_if_absent(self, key: str, data: memoryview) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def _stat(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> list[ObjectInfo]: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
