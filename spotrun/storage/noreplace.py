"""``rename`` that fails instead of replacing: Linux ``renameat2(..., RENAME_NOREPLACE)``.

The local backend commits a manifest with a hard link, which fails with ``EEXIST``
instead of overwriting. Some filesystems have no hard links (FUSE mounts of object
stores, FAT, some network filesystems) but do support this flag (FAT/exFAT, FUSE file
systems built on libfuse 3 that implement rename flags), and it keeps the same two
guarantees: the new name appears atomically with the whole file, and an existing name
is never replaced. Python's :mod:`os` has no binding for it, so this calls glibc's
``renameat2`` (glibc >= 2.28) through :mod:`ctypes`.
"""

from __future__ import annotations

import ctypes
import errno
import os

#: ``renameat2`` flag: fail with ``EEXIST`` when the new name exists.
RENAME_NOREPLACE = 1
_AT_FDCWD = -100

#: errnos of ``renameat2`` meaning "this kernel or filesystem cannot do it", not "it failed".
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):  # no glibc, or one older than 2.28
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _libc_renameat2()


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` atomically, unless ``dst`` exists.

    Args:
        src: existing file path.
        dst: new path, on the same filesystem.

    Raises:
        FileExistsError: ``dst`` exists; nothing changed.
        OSError: any other failure. ``errno`` in :data:`UNSUPPORTED_ERRNOS` means the
            C library, kernel or filesystem does not support the no-replace rename
            (``ENOSYS`` when the C library lacks ``renameat2``).
    """
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "the C library has no renameat2", src, None, dst)
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return
    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code), src, None, dst)
