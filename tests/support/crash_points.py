"""Persistence points of a save, and a SIGKILL at the N-th one (crash testing in the
manner of ALICE, OSDI'14), for the crash-consistency harness (tests/support/crash_campaign.py).

A *persistence point* is a moment where a writer's crash can leave a different state on
storage:

* local storage: just before every call that changes the file system under the
  checkpoint root - a file create (``os.open`` with ``O_CREAT`` or for writing, ``open``
  in a writing mode), every write call (``os.write``/``pwrite``/``writev``/``pwritev``),
  ``fsync``/``fdatasync``, ``ftruncate``/``posix_fallocate``, ``rename``/``replace``,
  ``link``, ``renameat2(RENAME_NOREPLACE)`` (:func:`spotrun.storage.noreplace.rename_noreplace`),
  ``unlink``, ``mkdir``/``rmdir``. A process crash (unlike a power loss) keeps every
  completed call and none of the later ones, so the crash states are exactly the
  prefixes of this sequence: a kill *before* each call reaches every one of them.
* S3: every request that changes the bucket (``PutObject``, ``CreateMultipartUpload``,
  ``UploadPart``, ``CompleteMultipartUpload``, ``AbortMultipartUpload``, ``DeleteObject``,
  ``DeleteObjects``, ``CopyObject``, ``UploadPartCopy``), twice: just before it is sent
  (botocore's ``before-call`` event) and just after its response arrived (``after-call``),
  since the server acts in between.

Everything is hooked at the ``os`` and botocore level, inside the worker process only,
so the harness does not depend on how spotrun's write path is built. Calls from every
thread count (a background save, parallel part uploads); a hook holds one lock while it
counts and, at the chosen point, while it records what is committed and kills the
process, so no other thread passes a persistence point in between.
"""

from __future__ import annotations

import builtins
import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable

#: The thread of spotrun's event log (spotrun/eventlog/records.py). Its writes are no persistence points
#: of a save: the log is a best-effort record for ``spotrun report``, rewritten whole from its
#: own thread whenever a record was added, so how many writes fall inside a save differs from
#: run to run, and no restore reads it. A kill at a save's points still lands while it writes.
EVENT_LOG_THREAD = "spotrun-event-log"
#: S3 operations that change the bucket; every other request only reads.
S3_MUTATING_OPERATIONS = frozenset(
    {
        "PutObject",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "DeleteObject",
        "DeleteObjects",
        "CopyObject",
        "UploadPartCopy",
    }
)

_WRITE_FLAGS = os.O_CREAT | os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
_TMP_SUFFIX = re.compile(r"\.tmp-[^/]*$")


class PointCounter:
    """Counts persistence points in order; at index ``kill_at`` it calls ``on_kill(index,
    name)`` and then SIGKILLs its own process.

    Args:
        kill_at: the 0-based index of the point to die at; ``None`` only counts (a dry run).
        on_kill: records the state before the kill (runs with every hook passing through).
    """

    def __init__(self, kill_at: int | None = None, on_kill: Callable[[int, str], None] | None = None) -> None:
        self.kill_at = kill_at
        self.on_kill = on_kill
        self.names: list[str] = []
        self._lock = threading.RLock()
        self._passing = False

    def point(self, name: str) -> None:
        """One persistence point is about to be passed (or was just passed, for S3 after-call).
        A point passed off the main thread is named with its thread."""
        thread = threading.current_thread()
        if thread.name == EVENT_LOG_THREAD:
            return  # not part of any save (see EVENT_LOG_THREAD)
        if thread is not threading.main_thread():
            name = f"{name} (thread {thread.name})"
        with self._lock:
            if self._passing:
                return
            index = len(self.names)
            self.names.append(name)
            if index != self.kill_at:
                return
            self._passing = True  # the snapshot below reads storage through the same hooks
            if self.on_kill is not None:
                self.on_kill(index, name)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()  # never reached: the kernel ends the process


def _at(path, dir_fd: int | None):
    """``path`` as the kernel resolves it relative to ``dir_fd`` (``unlinkat``, ``mkdirat``: the
    local backend deletes through directory descriptors, never through a link)."""
    if dir_fd is None or os.path.isabs(_path_text(path)):
        return path
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), _path_text(path))


def _path_text(path) -> str:
    if isinstance(path, int):
        return f"<fd {path}>"
    return os.fsdecode(os.fspath(path))


class LocalHooks:
    """Persistence points of the calls that change files under ``root``.

    :meth:`install` replaces the ``os`` functions (and ``open``, and spotrun's
    ``rename_noreplace`` wherever a module imported it) with counting wrappers; nothing
    is ever restored, because the process is a forked worker that ends after its save.
    """

    def __init__(self, root: str, counter: PointCounter) -> None:
        self._root = os.path.realpath(root)
        self._counter = counter
        self._fd_paths: dict[int, str] = {}

    def _relative(self, path) -> str | None:
        """``path`` relative to the root (temporary-file suffixes shortened), or ``None``
        when it lies elsewhere."""
        if isinstance(path, int):
            return self._fd_paths.get(path)
        text = os.path.realpath(_path_text(path))
        if text != self._root and not text.startswith(self._root + os.sep):
            return None
        return _TMP_SUFFIX.sub(".tmp-*", os.path.relpath(text, self._root))

    def _point(self, what: str, *paths) -> None:
        relative = [r for r in (self._relative(p) for p in paths) if r is not None]
        if relative:
            self._counter.point(f"{what} {' -> '.join(relative)}")

    def install(self) -> None:
        original = {
            name: getattr(os, name)
            for name in (
                "open",
                "write",
                "pwrite",
                "writev",
                "pwritev",
                "fsync",
                "fdatasync",
                "ftruncate",
                "truncate",
                "posix_fallocate",
                "replace",
                "rename",
                "link",
                "unlink",
                "remove",
                "mkdir",
                "rmdir",
            )
            if hasattr(os, name)
        }

        def on_path(name: str) -> None:
            call = original[name]

            def hooked(path, *args, **kwargs):
                self._point(f"os.{name}", _at(path, kwargs.get("dir_fd")))
                return call(path, *args, **kwargs)

            setattr(os, name, hooked)

        def on_two_paths(name: str) -> None:
            call = original[name]

            def hooked(src, dst, *args, **kwargs):
                self._point(f"os.{name}", src, dst)
                return call(src, dst, *args, **kwargs)

            setattr(os, name, hooked)

        def on_fd(name: str) -> None:
            call = original[name]

            def hooked(fd, *args, **kwargs):
                where = self._fd_paths.get(fd)
                if where is not None:
                    size = _payload_bytes(name, args)
                    self._counter.point(f"os.{name} {where}" + (f" ({size} bytes)" if size is not None else ""))
                return call(fd, *args, **kwargs)

            setattr(os, name, hooked)

        def hooked_open(path, flags, *args, **kwargs):
            writing = flags & _WRITE_FLAGS
            if writing:
                self._point("os.open(O_CREAT)" if flags & os.O_CREAT else "os.open(write)", path)
            fd = original["open"](path, flags, *args, **kwargs)
            relative = self._relative(path) if not isinstance(path, int) else None
            if relative is not None:
                self._fd_paths[fd] = relative  # fsync of a directory counts too
            else:
                self._fd_paths.pop(fd, None)  # a number reused after a close we did not see
            return fd

        def hooked_close(fd):
            self._fd_paths.pop(fd, None)  # bookkeeping only: a close changes nothing on disk
            return original_close(fd)

        original_close = os.close
        os.open = hooked_open
        os.close = hooked_close
        for name in ("write", "pwrite", "writev", "pwritev", "fsync", "fdatasync", "ftruncate", "posix_fallocate"):
            if name in original:
                on_fd(name)
        for name in ("truncate", "unlink", "remove", "mkdir", "rmdir"):
            on_path(name)
        for name in ("replace", "rename", "link"):
            on_two_paths(name)
        self._install_open()
        self._install_rename_noreplace()

    def _install_open(self) -> None:
        builtin_open = builtins.open

        def hooked(file, mode="r", *args, **kwargs):
            writing = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wxa+")
            if writing:
                self._point(f"open({mode!r})", file)
            handle = builtin_open(file, mode, *args, **kwargs)
            relative = self._relative(file) if isinstance(file, (str, bytes, os.PathLike)) else None
            if relative is not None:
                self._fd_paths[handle.fileno()] = relative
            elif isinstance(file, (str, bytes, os.PathLike)):
                self._fd_paths.pop(handle.fileno(), None)
            return handle

        builtins.open = hooked
        io.open = hooked

    def _install_rename_noreplace(self) -> None:
        from spotrun.storage import noreplace

        call = noreplace.rename_noreplace

        def hooked(src, dst):
            self._point("renameat2(RENAME_NOREPLACE)", src, dst)
            return call(src, dst)

        for module in list(sys.modules.values()):  # every module that imported it by name
            if module is not None and getattr(module, "rename_noreplace", None) is call:
                module.rename_noreplace = hooked


def _payload_bytes(name: str, args: tuple) -> int | None:
    try:
        if name in ("write", "pwrite"):
            return memoryview(args[0]).nbytes
        if name in ("writev", "pwritev"):
            return sum(memoryview(b).nbytes for b in args[0])
    except (TypeError, IndexError):
        return None
    return None


class S3Hooks:
    """Persistence points of the S3 requests that change the bucket, through botocore's
    event system: every client created after :meth:`install` reports ``before-call`` and
    ``after-call`` of each such request. Clients created before (the harness's own, for
    copying and inspecting) are not hooked."""

    def __init__(self, counter: PointCounter, prefix: str) -> None:
        self._counter = counter
        self._prefix = prefix.rstrip("/") + "/" if prefix else ""

    def _name(self, when: str, model, params: dict | None) -> str:
        params = params or {}
        key = str(params.get("Key", ""))
        key = key[len(self._prefix) :] if key.startswith(self._prefix) else key
        part = f" part {params['PartNumber']}" if "PartNumber" in params else ""
        condition = " If-None-Match" if params.get("IfNoneMatch") else ""
        return f"{when} {model.name}{condition} {key}{part}"

    def _before(self, model=None, context=None, **_ignored) -> None:
        if model is not None and model.name in S3_MUTATING_OPERATIONS:
            self._counter.point(self._name("before", model, (context or {}).get("crash_points_params")))

    def _after(self, model=None, http_response=None, context=None, **_ignored) -> None:
        if model is not None and model.name in S3_MUTATING_OPERATIONS:
            status = getattr(http_response, "status_code", "?")
            params = (context or {}).get("crash_points_params")
            self._counter.point(self._name("after", model, params) + f" -> HTTP {status}")

    @staticmethod
    def _remember_params(params=None, context=None, **_ignored) -> None:
        if context is not None and params is not None:
            context["crash_points_params"] = {k: params[k] for k in ("Key", "PartNumber", "IfNoneMatch") if k in params}

    def install(self) -> None:
        import botocore.session

        create_client = botocore.session.Session.create_client
        hooks = self

        def hooked(session, *args, **kwargs):
            client = create_client(session, *args, **kwargs)
            events = client.meta.events
            events.register("before-parameter-build.s3", hooks._remember_params)
            events.register("before-call.s3", hooks._before)
            events.register("after-call.s3", hooks._after)
            return client

        botocore.session.Session.create_client = hooked
