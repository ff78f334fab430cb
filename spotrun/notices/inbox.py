"""The supervisor's inbox: every notice source delivers here, and only the main loop reads it.

A thread-safe queue plus a self-pipe. A polling source posts from its own thread
(:meth:`Inbox.post`). Signals never run code in a handler: the signal source
(:mod:`spotrun.notices.signals`) has :func:`signal.set_wakeup_fd` write each signal number
into the pipe, whichever thread the kernel delivered it to, and the main loop turns those
bytes into events after it wakes up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import select
from collections.abc import Callable

_WAKE_BYTE = b"\0"  # not a signal number: "look at the queue"


class Inbox:
    """A thread-safe queue of events plus a self-pipe that wakes the main loop.

    ``post`` may be called from any thread; ``wait`` only from the supervisor's main loop.
    Close it (or use it as a context manager) to free the pipe.
    """

    def __init__(self) -> None:
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._signal_event: Callable[[int], object] = int  # replaced by the signal source
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)

    def route_signals(self, to_event: Callable[[int], object]) -> int:
        """Have each signal number read from the pipe handed out as ``to_event(signum)``.

        Returns:
            The write end of the self-pipe, for :func:`signal.set_wakeup_fd`.
        """
        self._signal_event = to_event
        return self._write_fd

    def post(self, event: object) -> None:
        """Deliver ``event`` (usually a :class:`~spotrun.notices.base.Notice`) to the main loop; never blocks."""
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

    def close(self) -> None:
        """Close the pipe; the inbox must not be used afterwards."""
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Inbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
