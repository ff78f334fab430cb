"""Preemption notices and the supervisor's inbox.

Every source of a preemption notice (a notice signal, a cloud metadata poller) delivers a
:class:`Notice` through one :class:`Inbox`, and the supervisor's main loop is the only
place that acts on it. No work happens inside a signal handler: the Python
handlers installed by :func:`signal_notices` do nothing, and :func:`signal.set_wakeup_fd`
makes the interpreter's C-level handler write the signal number into the inbox's
self-pipe, whichever thread the kernel delivered the signal to. The main loop turns those
bytes into events after it wakes up.

Events the inbox hands out (:meth:`Inbox.wait`):
    :class:`Notice`        a preemption notice (from a notice signal or from :meth:`Inbox.post`);
    :class:`IgnoredSignal` a signal that would have ended the supervisor but is no notice
                           (:mod:`spotrun.supervisor.signals`): log it, keep supervising;
    :data:`CHILD_EVENT`    SIGCHLD arrived: some child changed state, reap it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import select
import signal
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from spotrun.supervisor.signals import DEFAULT_NOTICE_SIGNALS, parse_notice_signals, signal_name, terminating_signals

#: Event meaning "a child process changed state" (SIGCHLD arrived).
CHILD_EVENT = "child"

_WAKE_BYTE = b"\0"  # not a signal number: "look at the queue"


@dataclass(frozen=True)
class Notice:
    """One preemption notice.

    Attributes:
        source: who sent it: ``"signal"``, later ``"aws"``, ``"gcp"``, ``"azure"``, ``"file"``.
        kind: what it says, e.g. ``"SIGTERM"`` or ``"spot instance-action terminate"``.
        received_unix_s: when the supervisor learned of it (seconds since the epoch).
        deadline_unix_s: when the machine goes away, if the source knows (seconds since the
            epoch); ``None`` means "the configured grace period from ``received_unix_s``".
        acknowledge: called once after the emergency checkpoint committed (Azure wants a
            ``StartRequests`` POST); ``None`` when the source needs no acknowledgement.
    """

    source: str
    kind: str
    received_unix_s: float
    deadline_unix_s: float | None = None
    acknowledge: Callable[[], None] | None = None


@dataclass(frozen=True)
class IgnoredSignal:
    """A signal that is not a notice arrived (e.g. SIGALRM, or SIGUSR1 left out of ``--notice-signals``).

    Attributes:
        signum: its number.
        name: its name (``"SIGALRM"``, ``"SIGRTMIN+3"``).
    """

    signum: int
    name: str


class Inbox:
    """A thread-safe queue of events plus a self-pipe that wakes the main loop.

    ``post`` may be called from any thread (a cloud notice poller); ``wait`` only from the
    supervisor's main loop. Close it (or use it as a context manager) to free the pipe.

    Args:
        notice_signals: signal numbers that are notices (default
            :data:`~spotrun.supervisor.signals.DEFAULT_NOTICE_SIGNALS`); any other signal the
            wakeup fd reports becomes an :class:`IgnoredSignal`.
    """

    def __init__(self, notice_signals: Collection[int] | None = None) -> None:
        self.notice_signals = frozenset(
            parse_notice_signals(DEFAULT_NOTICE_SIGNALS) if notice_signals is None else notice_signals
        )
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)

    @property
    def wakeup_fd(self) -> int:
        """Write end of the self-pipe (for :func:`signal.set_wakeup_fd`)."""
        return self._write_fd

    def post(self, event: object) -> None:
        """Deliver ``event`` (usually a :class:`Notice`) to the main loop; never blocks."""
        self._events.put(event)
        with contextlib.suppress(BlockingIOError):  # pipe full: a wakeup is already pending
            os.write(self._write_fd, _WAKE_BYTE)

    def wait(self, timeout_s: float | None) -> list[object]:
        """Block until at least one event is pending or ``timeout_s`` passed; return all pending.

        Args:
            timeout_s: seconds to wait at most; ``None`` waits without limit, ``0`` polls.

        Returns:
            The events in arrival order (signals read from the pipe first); empty on timeout.
        """
        events = self._drain()
        if events or (timeout_s is not None and timeout_s <= 0):
            return events
        select.select([self._read_fd], [], [], timeout_s)  # retried on EINTR (PEP 475)
        return self._drain()

    def _drain(self) -> list[object]:
        events: list[object] = []
        while True:
            try:
                data = os.read(self._read_fd, 4096)
            except BlockingIOError:
                break
            if not data:
                break
            events.extend(self._signal_event(signum) for signum in data if signum != _WAKE_BYTE[0])
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        return events

    def _signal_event(self, signum: int) -> object:
        if signum == signal.SIGCHLD:
            return CHILD_EVENT
        if signum in self.notice_signals:
            return Notice(source="signal", kind=signal_name(signum), received_unix_s=time.time())
        return IgnoredSignal(signum=signum, name=signal_name(signum))

    def close(self) -> None:
        """Close the pipe; the inbox must not be used afterwards."""
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> "Inbox":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _ignore(signum: int, frame: object) -> None:
    """Python-level handler: nothing to do; the wakeup fd already carries the signal."""


@contextlib.contextmanager
def signal_notices(inbox: Inbox) -> Iterator[None]:
    """Route every signal that would end the supervisor, and SIGCHLD, into ``inbox`` while active.

    The inbox's notice signals become :class:`Notice` events, every other signal of
    :func:`~spotrun.supervisor.signals.terminating_signals` an :class:`IgnoredSignal`, so no
    such signal can end the supervisor and leave its job unsupervised. Fault signals
    (SIGSEGV, ...) keep their default action. Must be entered in the main thread. These
    signals are also unblocked in this thread: a parent may have blocked them and the mask
    is inherited (a blocked SIGCHLD would leave exited children unnoticed, a blocked SIGTERM
    would swallow the notice). Handlers, unlike ``SIG_IGN``, are reset to the default by
    ``exec``, so the launch command starts with default dispositions. The previous handlers,
    wakeup fd and signal mask are restored on exit.

    Raises:
        ValueError: not called from the main thread.
    """
    watched = tuple(sorted({*terminating_signals(), *inbox.notice_signals, signal.SIGCHLD}))
    previous = {signum: signal.getsignal(signum) for signum in watched}
    old_fd = signal.set_wakeup_fd(inbox.wakeup_fd, warn_on_full_buffer=False)
    old_mask = None
    try:
        for signum in watched:
            signal.signal(signum, _ignore)
        old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        yield
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(old_fd)
