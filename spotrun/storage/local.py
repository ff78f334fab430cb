"""Local-directory storage backend (the default).

Atomicity comes from POSIX: each object is written to a hidden temporary file in the same
directory, fsynced, then renamed (``put``) or hard-linked (``put_if_absent``, which never
overwrites) onto its key; ``renameat2(RENAME_NOREPLACE)`` where there are no hard links, and
:class:`~spotrun.errors.CommitUnsupportedError` where neither works. No symbolic link below the
root is followed (:mod:`spotrun.storage.local_beneath`). Details:
``docs/design/internals.md`` (Storage).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from spotrun.errors import (
    CommitUnsupportedError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooShortError,
    StorageError,
    StoragePermissionError,
)
from spotrun.storage import local_beneath as beneath
from spotrun.storage.base import ByteSource, ChunkCallback, ObjectInfo, Storage, UnfinishedUpload
from spotrun.storage.noreplace import UNSUPPORTED_ERRNOS, rename_noreplace

log = logging.getLogger(__name__)

#: Bytes handed to one ``write`` call; large shards are written in pieces of this size.
DEFAULT_WRITE_CHUNK_BYTES = 8 * 1024 * 1024
_TMP_MARK = ".tmp-"
#: Times a write makes its directories again when a concurrent delete removed them in between.
_MAKE_DIRS_ATTEMPTS = 5
#: Objects streamed by ``put_stream`` from this size on are written with O_DIRECT.
DIRECT_IO_MIN_BYTES = 4 * 1024 * 1024
#: O_DIRECT transfers are multiples of this (covers 512-byte and 4 KiB logical blocks).
_DIRECT_ALIGN_BYTES = 4096
#: Most buffers one ``preadv`` call takes (the kernel's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
#: Chunks filled (copied out of the source and hashed) ahead of the one being written.
_FILL_AHEAD = 2

#: Commit primitives of ``put_if_absent``, as :attr:`LocalStorage.commit_primitive` names them.
HARD_LINK = "hard link"
RENAME_NOREPLACE = "rename without replace (renameat2 RENAME_NOREPLACE)"
#: errnos of ``link`` meaning "this filesystem has no hard links".
_NO_LINK_ERRNOS = frozenset({errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP})


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


def _translate(exc: OSError, what: str, *, writing: bool = False) -> StorageError:
    if isinstance(exc, FileNotFoundError) and writing:  # a directory on the way could not be made
        where = f" ({exc.filename})" if exc.filename else ""
        return StorageError(
            errno.ENOENT, f"{what}: cannot create the directory to hold it{where}: {exc.strerror or exc}"
        )
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(errno.EACCES, f"{what}: permission denied")
    return StorageError(exc.errno or errno.EIO, f"{what}: {exc.strerror or exc}")


class LocalStorage(Storage):
    """Objects as files under ``root_dir``.

    Args:
        root_dir: directory of the store; created on first write.
        write_chunk_bytes: size of each ``write`` call when storing an object.
        fsync: flush data and directory entries to disk before a put returns (durable
            across a power loss); tests may turn it off for speed.
        direct_io: ``put_stream`` writes objects of at least :data:`DIRECT_IO_MIN_BYTES`
            with ``O_DIRECT`` from an aligned bounce buffer, bypassing the page cache (a
            buffered write plus ``fsync`` runs at the speed of the kernel's writeback, several
            times slower than the disk on the machines measured). Filesystems that refuse
            ``O_DIRECT`` (tmpfs, some FUSE mounts) get buffered writes, found on first use.
    """

    commit_requirement = "a no-overwrite commit (hard link or rename without replace)"
    unfinished_upload_kind = "temporary file"
    commit_advice = "put the checkpoint root on a local filesystem (ext4, xfs, btrfs, tmpfs...)"

    def __init__(
        self,
        root_dir: str,
        *,
        write_chunk_bytes: int = DEFAULT_WRITE_CHUNK_BYTES,
        fsync: bool = True,
        direct_io: bool = True,
    ) -> None:
        if write_chunk_bytes <= 0:
            raise ValueError(f"write_chunk_bytes must be positive, got {write_chunk_bytes}")
        self._root = os.path.abspath(os.path.expanduser(root_dir))
        self._write_chunk_bytes = write_chunk_bytes
        self._fsync = fsync
        self._direct_io = direct_io
        self._commit_primitive: str | None = None

    @property
    def uri(self) -> str:
        return self._root

    @property
    def commit_primitive(self) -> str | None:
        """How ``put_if_absent`` commits here: :data:`HARD_LINK`, :data:`RENAME_NOREPLACE`,
        or ``None`` before its first successful use."""
        return self._commit_primitive

    def _path(self, key: str) -> str:
        return os.path.join(self._root, *key.split("/"))

    def _open(self, key: str, what: str) -> int:
        """A read-only descriptor of ``key``'s regular file, reached without following a link."""
        try:
            return beneath.open_file(self._root, key.split("/"))
        except StorageError:
            raise
        except OSError as exc:
            raise _translate(exc, f"{what} {self._path(key)}") from exc

    # --- writing --------------------------------------------------------------

    def _write_temporary(self, key: str, write: Callable[[int], None]) -> str:
        """A hidden temporary file beside ``key``'s, written by ``write(fd)`` and fsynced;
        returns its path (removed again if anything fails)."""
        final = self._path(key)
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, f".{os.path.basename(final)}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        for attempt in range(_MAKE_DIRS_ATTEMPTS):
            os.makedirs(self._root, exist_ok=True)
            try:
                # the directories of the key, made where missing, none of them a link (a step
                # directory planted as a link would take the save outside the root)
                beneath.close_all(beneath.open_dirs(self._root, key.split("/")[:-1], create=True))
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileNotFoundError:
                # another writer's delete removed the directory as it emptied (two supervisors'
                # preflight probes): made again; once the file is in it, it is not empty any more
                if attempt == _MAKE_DIRS_ATTEMPTS - 1:
                    raise
        try:
            write(fd)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _write_chunks(self, fd: int, data: memoryview) -> None:
        offset = 0
        while offset < len(data):
            offset += os.write(fd, data[offset : offset + self._write_chunk_bytes])

    def _sync_dir(self, key: str) -> None:
        if not self._fsync:
            return
        fd = os.open(os.path.dirname(self._path(key)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _put(self, key: str, data: memoryview) -> None:
        self._put_written(key, lambda fd: self._write_chunks(fd, data))

    def _put_written(self, key: str, write: Callable[[int], None]) -> None:
        """Write a temporary file with ``write(fd)``, then rename it onto ``key`` (replacing)."""
        try:
            tmp = self._write_temporary(key, write)
            try:
                os.replace(tmp, self._path(key))
            except BaseException:
                _unlink_quietly(tmp)
                raise
            self._sync_dir(key)
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise _translate(exc, f"put {self._path(key)}", writing=True) from exc

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        """Write ``source`` chunk by chunk to a temporary file, fsync, rename onto ``key``.

        Helper threads copy the next chunks out of the source into page-aligned bounce
        buffers and hash them (``on_chunk``) while this thread writes the previous one, so
        copying, hashing and the disk overlap; memory held: ``_FILL_AHEAD + 1`` chunks.
        """
        self._put_written(key, lambda fd: self._stream_to(fd, source, chunk_bytes, on_chunk))

    def _stream_to(self, fd: int, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        size = source.size_bytes
        starts = list(range(0, size, chunk_bytes))
        # O_DIRECT needs every write to start at an aligned offset: chunks of an aligned size
        direct = (
            self._direct_io
            and size >= DIRECT_IO_MIN_BYTES
            and chunk_bytes % _DIRECT_ALIGN_BYTES == 0
            and _set_direct(fd, True)
        )
        buffer_bytes = -(-min(chunk_bytes, max(size, 1)) // _DIRECT_ALIGN_BYTES) * _DIRECT_ALIGN_BYTES
        buffers = [mmap.mmap(-1, buffer_bytes) for _ in range(min(len(starts), _FILL_AHEAD + 1))]

        def fill(index: int) -> memoryview:
            start = starts[index]
            view = memoryview(buffers[index % len(buffers)])[: min(chunk_bytes, size - start)]
            source.readinto(start, view)
            if on_chunk is not None:
                on_chunk(start, view)
            return view

        if len(starts) <= 1:  # nothing to overlap
            for index in range(len(starts)):
                direct = self._write_chunk(fd, fill(index), buffers[0], direct)
        else:
            with ThreadPoolExecutor(max_workers=_FILL_AHEAD, thread_name_prefix="spotrun-fill") as pool:
                pending: deque[Future] = deque(pool.submit(fill, i) for i in range(len(buffers)))
                try:
                    for index in range(len(starts)):
                        view = pending.popleft().result()
                        direct = self._write_chunk(fd, view, buffers[index % len(buffers)], direct)
                        if index + len(buffers) < len(starts):
                            pending.append(pool.submit(fill, index + len(buffers)))
                finally:
                    for future in pending:
                        future.cancel()
        if direct and size % _DIRECT_ALIGN_BYTES:
            os.ftruncate(fd, size)  # the last write was padded to the alignment

    @staticmethod
    def _write_chunk(fd: int, view: memoryview, buffer: mmap.mmap, direct: bool) -> bool:
        """Write ``view`` (a prefix of ``buffer``); returns whether O_DIRECT is still on."""
        data = view
        if direct:
            padded = -(-len(view) // _DIRECT_ALIGN_BYTES) * _DIRECT_ALIGN_BYTES
            data = memoryview(buffer)[:padded]
        written = 0
        while written < len(data):
            try:
                written += os.write(fd, data[written:])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                # the filesystem takes O_DIRECT at open but not these writes: go buffered
                _set_direct(fd, False)
                direct, data = False, view
        return direct

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        path = self._path(key)
        fd = self._open(key, "read")
        try:
            pending = [v for v in views if len(v)]
            if not pending and offset > os.fstat(fd).st_size:
                raise ObjectTooShortError(errno.EIO, f"read {path}: offset {offset} is past its end")
            first = 0
            while first < len(pending):
                try:
                    count = os.preadv(fd, pending[first : first + _IOV_MAX], offset)
                except OSError as exc:
                    raise _translate(exc, f"read {path}") from exc
                if count == 0:
                    raise ObjectTooShortError(
                        errno.EIO,
                        f"read {path}: the object ends at byte {offset}, before the "
                        f"{sum(len(v) for v in pending[first:])} bytes asked for",
                    )
                offset += count
                while first < len(pending) and count >= len(pending[first]):
                    count -= len(pending[first])
                    first += 1
                if count:
                    pending[first] = pending[first][count:]
        finally:
            os.close(fd)

    def _put_if_absent(self, key: str, data: memoryview) -> None:
        final = self._path(key)
        try:
            tmp = self._write_temporary(key, lambda fd: self._write_chunks(fd, data))
            try:
                self._commit(tmp, final)
            finally:
                _unlink_quietly(tmp)  # a hard link leaves it; a rename took it
            self._sync_dir(key)
        except FileExistsError as exc:
            raise ObjectExistsError(errno.EEXIST, f"{final} already exists") from exc
        except CommitUnsupportedError:
            raise
        except OSError as exc:
            raise _translate(exc, f"put_if_absent {final}", writing=True) from exc

    def _commit(self, tmp: str, final: str) -> None:
        """Give ``tmp`` the name ``final`` unless ``final`` exists (``FileExistsError``)."""
        link_failure = "not supported"
        if self._commit_primitive != RENAME_NOREPLACE:
            try:
                os.link(tmp, final)  # fails with EEXIST, never overwrites
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS or self._commit_primitive == HARD_LINK:
                    raise
                link_failure = exc.strerror or str(exc)
            else:
                self._commit_primitive = HARD_LINK
                return
        try:
            rename_noreplace(tmp, final)
        except OSError as exc:
            if exc.errno not in UNSUPPORTED_ERRNOS:
                raise
            raise CommitUnsupportedError(
                exc.errno,
                f"put_if_absent {final}: the filesystem of {self._root} cannot commit a checkpoint "
                f"without risking an overwrite: it has no hard links (link: "
                f"{link_failure}) and no rename that refuses to replace (renameat2 "
                f"RENAME_NOREPLACE: {exc.strerror}). Put the checkpoint root on a local "
                "filesystem (ext4, xfs, btrfs, tmpfs...), or reach an object store through its "
                "S3 API (--checkpoint-uri s3://bucket/prefix) instead of a FUSE mount",
            ) from exc
        if self._commit_primitive is None:
            log.info(
                "%s has no hard links (%s): checkpoints commit with renameat2 RENAME_NOREPLACE",
                self._root,
                link_failure,
            )
        self._commit_primitive = RENAME_NOREPLACE

    # --- reading --------------------------------------------------------------

    def _get(self, key: str) -> bytes:
        fd = self._open(key, "get")
        try:
            with open(fd, "rb", closefd=False) as f:
                return f.read()
        except OSError as exc:
            raise _translate(exc, f"get {self._path(key)}") from exc
        finally:
            os.close(fd)

    def _stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = beneath.stat_file(self._root, key.split("/"))
        except StorageError:
            raise
        except OSError as exc:
            raise _translate(exc, f"stat {path}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(errno.ENOENT, f"stat {path}: not a file")
        return ObjectInfo(key=key, size_bytes=st.st_size, mtime_s=st.st_mtime)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [
            ObjectInfo(
                key=key,
                size_bytes=st.st_size if refused is None else 0,
                mtime_s=st.st_mtime if st is not None else 0.0,
                refused=refused,
            )
            for key, st, refused in self._walk(prefix, temporary=False)
        ]

    def _unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """The hidden temporary files of writers that never renamed them (a killed writer's,
        or a running one's), with their last modification."""
        return [
            UnfinishedUpload(key=key, time_unix_s=st.st_mtime)
            for key, st, refused in self._walk(prefix, temporary=True)
            if refused is None
        ]

    def _abort_upload(self, upload: UnfinishedUpload) -> None:
        if not _is_temporary(upload.key.rpartition("/")[2]):
            raise StorageError(errno.EINVAL, f"{self._path(upload.key)} is not a temporary file of a write")
        self._delete(upload.key)

    def _walk(self, prefix: str, *, temporary: bool) -> list[tuple[str, os.stat_result | None, str | None]]:
        """(key, lstat, refusal) of the entries under ``prefix``: the objects, or (``temporary``)
        the hidden temporary files of writes in progress or abandoned; no link is followed (a
        refused entry: ``refusal`` says why; a link on the way to ``prefix`` is one, its key the
        link's)."""
        # Walk only the deepest directory the prefix names, then filter by the prefix.
        base_dir = prefix.rpartition("/")[0]
        found = []
        for parts, st, refused in beneath.walk(self._root, base_dir.split("/") if base_dir else []):
            if _is_temporary(parts[-1]) != temporary:
                continue
            key = "/".join(parts)
            if key.startswith(prefix) or (refused is not None and prefix.startswith(key + "/")):
                found.append((key, st, refused))
        return found

    def _delete(self, key: str) -> None:
        # the directories on the way are reached without following a link: a step directory
        # that is a link is refused, never a file outside the root deleted through it
        try:
            beneath.remove_file(self._root, key.split("/"))
        except FileNotFoundError:
            return
        except StorageError:
            raise
        except OSError as exc:
            raise _translate(exc, f"delete {self._path(key)}") from exc


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; returns whether it is on (False where refused)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
