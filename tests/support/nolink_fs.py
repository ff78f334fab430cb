"""A real FUSE filesystem without hard links, for tests: a passthrough to a backing directory.

    python -m tests.support.nolink_fs BACKING_DIR MOUNTPOINT --rename-flags honour

Like the FUSE mounts of object stores, it has no hard links: its ``link`` answers
``ENOSYS`` (not implemented), which the kernel's FUSE client reports to the caller of
``link(2)`` as ``EPERM``.
What it does with ``rename(2)`` flags (``renameat2``) is ``--rename-flags``:

* ``honour``: ``RENAME_NOREPLACE`` is kept, by ``renameat2`` on the backing directory;
* ``refuse``: any flag fails with ``EINVAL``, as on filesystems without the flag (and on
  every filesystem served by libfuse 2, which has no ``rename`` flags: the kernel gets
  ``ENOSYS`` and reports ``EINVAL``).

(A filesystem that received the flag and ignored it would still not replace a name the
kernel can see: the kernel checks ``RENAME_NOREPLACE`` itself before calling the
filesystem, under the directory's lock. Such a filesystem is only unsafe against writers
on other machines sharing it.)

Everything else passes through. It runs in the foreground on libfuse 3 (mfusepy; set
``FUSE_LIBRARY_PATH`` to ``libfuse3.so.3``), single-threaded, until unmounted or
SIGTERM. ``tests/unit/storage/test_commit_primitive_fuse.py`` has the fixture that mounts it.
"""

from __future__ import annotations

import argparse
import errno
import os

import mfusepy

from spotrun.storage.noreplace import RENAME_NOREPLACE, rename_noreplace

_STAT_FIELDS = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks")
_TIME_FIELDS = ("st_atime", "st_mtime", "st_ctime")


class NoLinkPassthrough(mfusepy.Operations):
    """Passthrough operations over ``backing_dir``; no ``link``; ``rename_flags`` as above."""

    use_ns = True

    def __init__(self, backing_dir: str, rename_flags: str) -> None:
        self.backing_dir = os.path.abspath(backing_dir)
        self.rename_flags = rename_flags

    def _path(self, path: str) -> str:
        return os.path.join(self.backing_dir, path.lstrip("/"))

    # --- metadata ---------------------------------------------------------------

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        attrs = {name: getattr(st, name) for name in _STAT_FIELDS}
        attrs.update({name: getattr(st, f"{name}_ns") for name in _TIME_FIELDS})
        return attrs

    def access(self, path, amode):
        if not os.access(self._path(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)
        return 0

    def utimens(self, path, times=None):
        os.utime(self._path(path), ns=times)
        return 0

    def statfs(self, path):
        sv = os.statvfs(self._path(path))
        return {
            name: getattr(sv, name)
            for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
        }

    # --- directories ------------------------------------------------------------

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)
        return 0

    def rmdir(self, path):
        os.rmdir(self._path(path))
        return 0

    # --- names ------------------------------------------------------------------

    def unlink(self, path):
        os.unlink(self._path(path))
        return 0

    def link(self, target, source):
        raise mfusepy.FuseOSError(errno.ENOSYS)

    def rename(self, old, new, flags=0):
        if flags and self.rename_flags == "refuse":
            raise mfusepy.FuseOSError(errno.EINVAL)
        if flags & RENAME_NOREPLACE and self.rename_flags == "honour":
            rename_noreplace(self._path(old), self._path(new))
        else:
            os.rename(self._path(old), self._path(new))
        return 0

    # --- file contents ----------------------------------------------------------

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def open(self, path, flags):
        return os.open(self._path(path), flags & ~(os.O_CREAT | os.O_EXCL))

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        os.truncate(self._path(path) if fh is None else fh, length)
        return 0

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0


class _RenameFlagsFUSE(mfusepy.FUSE):
    """mfusepy drops the flags of libfuse 3's ``rename``; pass them to the operations."""

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename(
            old.decode(self.encoding, self.errors), new.decode(self.encoding, self.errors), flags
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing_dir")
    parser.add_argument("mountpoint")
    parser.add_argument("--rename-flags", choices=["honour", "refuse"], default="refuse")
    args = parser.parse_args()
    operations = NoLinkPassthrough(args.backing_dir, args.rename_flags)
    _RenameFlagsFUSE(operations, args.mountpoint, foreground=True, nothreads=True, fsname="spotrun-nolink")


if __name__ == "__main__":
    main()
