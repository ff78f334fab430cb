"""Reaching files below a local checkpoint root without following symbolic links (issue 21).

The rule: **no symbolic link below the root is followed**, wherever it points; nor is a file
opened that is not a regular file. A key whose way from the root passes a link is refused
with :class:`~spotrun.errors.UnsafeObjectError`, which the catalog and every reader treat as a
corrupt step. Why every link is refused, how (``openat`` with ``O_NOFOLLOW``) and what is not
defended against: ``docs/design/internals.md`` (Storage).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence

from spotrun.errors import ObjectNotFoundError, UnsafeObjectError

#: Why a link below the root is refused (the reason a listing and the errors give).
LINK_REFUSED = "a symbolic link; spotrun follows no link below a checkpoint root (it could lead outside the root)"
#: Why a FIFO, socket or device is refused.
SPECIAL_REFUSED = "not a regular file (a FIFO, socket or device: reading it could block forever)"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def refusal(root: str, parts: Sequence[str], reason: str) -> UnsafeObjectError:
    """The error of an entry refused under ``root``; its message names the path."""
    return UnsafeObjectError(errno.ELOOP, f"{os.path.join(root, *parts)}: {reason}")


def _is_link(parent_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_child_dir(parent_fd: int, root: str, parts: Sequence[str], create: bool) -> int:
    name = parts[-1]
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:  # a link gives ENOTDIR (with O_DIRECTORY) or ELOOP
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent_fd, name):
            raise refusal(root, parts, LINK_REFUSED) from exc
        raise
    try:  # by path, as every other change a writer makes (the crash tests count them by path)
        os.mkdir(os.path.join(root, *parts))
    except FileExistsError:
        pass
    return _open_child_dir(parent_fd, root, parts, create=False)


def open_dirs(root: str, parts: Sequence[str], *, create: bool = False) -> list[int]:
    """Descriptors of ``root`` and of each directory ``parts`` names below it, in order, each
    opened without following a link (``create``: make the missing ones). The caller closes them.

    Raises:
        UnsafeObjectError: one of them is a symbolic link.
        OSError: as ``open`` raises it (``FileNotFoundError``: absent, ``NotADirectoryError``).
    """
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for depth in range(1, len(parts) + 1):
            fds.append(_open_child_dir(fds[-1], root, parts[:depth], create))
    except BaseException:
        close_all(fds)
        raise
    return fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def open_file(root: str, parts: Sequence[str]) -> int:
    """A read-only descriptor of the regular file ``parts`` names below ``root``.

    Raises:
        UnsafeObjectError: a link on the way or in its place, or not a regular file.
        ObjectNotFoundError: it is a directory.
        OSError: as ``open`` raises it.
    """
    fds = open_dirs(root, parts[:-1])
    try:
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refusal(root, parts, LINK_REFUSED) from exc
        raise
    finally:
        close_all(fds)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise ObjectNotFoundError(errno.ENOENT, f"{os.path.join(root, *parts)}: is a directory")
        raise refusal(root, parts, SPECIAL_REFUSED)
    return fd


def stat_file(root: str, parts: Sequence[str]) -> os.stat_result:
    """``lstat`` of the entry ``parts`` names, reached without following a link.

    Raises:
        UnsafeObjectError: a link on the way or in its place, a FIFO, socket or device.
        OSError: as ``stat`` raises it.
    """
    fds = open_dirs(root, parts[:-1])
    try:
        st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
    finally:
        close_all(fds)
    if stat.S_ISLNK(st.st_mode):
        raise refusal(root, parts, LINK_REFUSED)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise refusal(root, parts, SPECIAL_REFUSED)
    return st


def remove_file(root: str, parts: Sequence[str]) -> None:
    """Unlink the entry ``parts`` names (a link itself, never what it points at), then remove
    the directories it leaves empty, up to the root; every directory reached without following
    a link, so nothing outside the root is ever deleted.

    Raises:
        UnsafeObjectError: a directory on the way is a symbolic link (nothing is deleted).
        FileNotFoundError: no such entry.
        OSError: as ``unlink`` raises it.
    """
    fds = open_dirs(root, parts[:-1])
    try:
        os.unlink(parts[-1], dir_fd=fds[-1])
        for depth in range(len(parts) - 1, 0, -1):
            try:
                os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
            except OSError:  # not empty (or gone): the ones above are not empty either
                break
    finally:
        close_all(fds)


def walk(root: str, base: Sequence[str]) -> Iterator[tuple[tuple[str, ...], os.stat_result | None, str | None]]:
    """``(parts, lstat, refusal)`` of every entry that is not a directory below ``root/base``,
    descending into no link: ``refusal`` is ``None`` for a regular file, else why it cannot be
    opened. A link in place of ``base`` or of a directory on its way is one refused entry
    (``lstat`` ``None``); an absent ``base`` has no entries."""
    try:
        fds = open_dirs(root, base)
    except UnsafeObjectError:  # open_dirs refuses links only
        yield tuple(base), None, LINK_REFUSED
        return
    except (FileNotFoundError, NotADirectoryError):
        return
    close_all(fds[:-1])
    yield from _walk_fd(fds[-1], tuple(base))


def _walk_fd(fd: int, parts: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], os.stat_result | None, str | None]]:
    """Entries below the open directory ``fd`` (closed at the end)."""
    try:
        with os.scandir(fd) as entries:
            found = sorted(entries, key=lambda e: e.name)
        for entry in found:
            here = parts + (entry.name,)
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted while listing
                continue
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # replaced by a link since scandir saw a directory
                    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    yield here, None, LINK_REFUSED
                    continue
                yield from _walk_fd(child, here)
            elif stat.S_ISLNK(st.st_mode):
                yield here, st, LINK_REFUSED
            elif stat.S_ISREG(st.st_mode):
                yield here, st, None
            else:
                yield here, st, SPECIAL_REFUSED
    finally:
        os.close(fd)
