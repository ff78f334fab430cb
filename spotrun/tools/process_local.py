"""What spotrun sets up in a training process stays in that process: a forked child never
acts on it.

A training script forks at any moment: DataLoader workers at each epoch (fork is Linux's
default), a ``multiprocessing.Pool``, a ``multiprocessing.Process``. The child inherits every
exit hook and signal handler set before the fork, and ``multiprocessing`` runs the early exit
hooks (``threading._register_atexit``) when the child ends. Without the checks here, a loader
worker ran the background saver's hook: it waited for the parent's save (a copy of an event
nothing in the child sets) and destroyed the copy of a gloo process group whose threads live
only in the parent, which aborts the child (field case C18); and a pool worker ignored the
SIGTERM of ``Pool.terminate()`` through the rank's inherited handler, so the pool's exit hung.
Every exit hook spotrun registers goes through :func:`at_exit`, every signal handler it installs
is undone in a child by :func:`in_forked_children`.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def at_exit(callback: Callable[..., None], *args: Any, before_thread_pools: bool = False) -> None:
    """Run ``callback(*args)`` at interpreter exit, in this process only.

    ``before_thread_pools``: run it when the interpreter starts to shut down, while
    ``concurrent.futures`` still accepts work (its own hook stops that in the same phase, and
    hooks registered after it run first); plain ``atexit`` where that hook is missing. Nothing
    is registered once shutdown is under way.
    """
    owner_pid = os.getpid()

    def in_owner() -> None:
        if os.getpid() == owner_pid:
            callback(*args)

    register = getattr(threading, "_register_atexit", None) if before_thread_pools else None
    if register is not None:
        try:
            register(in_owner)
        except RuntimeError:  # shutdown already under way
            pass
        return
    atexit.register(in_owner)


def in_forked_children(callback: Callable[[T], None], owner: T, *, held_signals: frozenset[int] = frozenset()) -> None:
    """Call ``callback(owner)`` in every child forked by ``os.fork`` (and so by
    ``multiprocessing``'s fork start method) from now on, while ``owner`` is alive. It runs
    in the child right after the fork, before anything else; what it raises is not caught.

    ``held_signals`` are blocked in the forking thread across the fork and unblocked in the
    child only after ``callback``: one sent to the child at once (``Process.terminate()``
    right after ``start()``) then meets the handler ``callback`` left, not the parent's.
    """
    ref = weakref.ref(owner)
    held = threading.local()

    def before() -> None:
        if held_signals and ref() is not None:
            held.mask = signal.pthread_sigmask(signal.SIG_BLOCK, held_signals)

    def release() -> None:
        mask = getattr(held, "mask", None)
        if mask is not None:
            held.mask = None
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def in_child() -> None:
        try:
            alive = ref()
            if alive is not None:
                callback(alive)
        finally:
            release()

    os.register_at_fork(before=before, after_in_parent=release, after_in_child=in_child)
