"""The one storage interface every checkpoint backend implements.

Keys are ``/``-separated strings relative to the backend's root URI (``step-000000100/
manifest.json``); they are never ``pathlib.Path`` objects, because a ``Path`` collapses
the double slash of ``s3://``. Public methods validate the key and then call a small
``_hook`` that each backend fills in.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from spotrun.errors import ConfigError


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object.

    Attributes:
        key: key relative to the root, ``/``-separated.
        size_bytes: object size in bytes.
        mtime_s: last modification, seconds since the Unix epoch (UTC).
    """

    key: str
    size_bytes: int
    mtime_s: float


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

    Contract (checked by ``tests/test_storage_contract.py`` against every backend):
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

    # --- hooks for backends ---------------------------------------------------

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
