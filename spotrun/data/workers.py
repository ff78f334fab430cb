"""Loader workers that survive stop signals not sent by their parent.

torchrun forwards SIGTERM to each rank's whole process group, and a spot VM's shutdown
signals every process. torch's loader workers die on a SIGTERM that does not come from their
parent, and the rank then raises ``DataLoader worker ... is killed by signal`` before it can
save (field case C09). Workers of :class:`spotrun.data.loader.ResumableDataLoader` therefore ignore
SIGTERM and SIGINT unless the parent sends them (the rank decides when to stop, and shuts them
down as usual); the signals are blocked while workers start, so none slips in before the
worker has set that up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class IgnoreStopSignals:
    """``worker_init_fn`` wrapper: stop signals from anyone but the parent are ignored.

    The worker keeps SIGTERM and SIGINT blocked and a daemon thread takes them with
    ``sigwaitinfo``, which tells who sent each: a SIGTERM from the parent (the loader's or
    multiprocessing's own shutdown) ends the worker at once, as torch's handler does;
    anything else (torchrun's ``killpg``, a VM-wide shutdown, Ctrl-C) is dropped, and the
    rank decides when its workers stop.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # already so when forked
        threading.Thread(target=_take_stop_signals, name="spotrun-stop-signals", daemon=True).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _take_stop_signals() -> None:
    while True:
        info = signal.sigwaitinfo(_STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == os.getppid():
            os._exit(0)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGTERM/SIGINT in this thread while loader workers are forked: they inherit the
    mask, so no stop signal reaches them before :class:`IgnoreStopSignals` runs; one that
    arrives for this process meanwhile waits, then is handled as usual."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
