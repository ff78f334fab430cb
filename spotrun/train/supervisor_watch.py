"""Worker side of "the job dies with its supervisor": watch ``spotrun run`` and outlive it only briefly.

The first :class:`~spotrun.Checkpointer` of a worker process starts one :class:`SupervisorWatch`
(a pidfd of ``$SPOTRUN_SUPERVISOR_PID``, checked to be an ancestor). When the supervisor exits
by any means, :attr:`SupervisorWatch.gone` makes the next ``end_of_step`` save and stop; a
process still running a grace period later SIGKILLs itself. Details:
``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

from spotrun.control.env import WorkerEnv

log = logging.getLogger(__name__)

#: Grace period assumed when ``$SPOTRUN_GRACE_PERIOD_S`` is unset, in seconds.
DEFAULT_GRACE_PERIOD_S = 30.0
#: Seconds between two looks at the process tree where no pidfd can be opened.
POLL_S = 0.5

_lock = threading.Lock()
_watches: dict[int, SupervisorWatch | None] = {}  # by the pid of the watching process


class SupervisorWatch:
    """Watches one supervisor process from a worker; ends this process after it is gone.

    Args:
        supervisor_pid: the supervisor's process id; it must be an ancestor of this process.
        grace_period_s: seconds this process may run on after the supervisor is gone.
        pidfd: an open pidfd of the supervisor (owned by the watch from now on), or ``None``
            to poll the process tree instead.
    """

    def __init__(self, supervisor_pid: int, grace_period_s: float, pidfd: int | None) -> None:
        self.supervisor_pid = supervisor_pid
        self.grace_period_s = grace_period_s
        self._pidfd = pidfd
        self._gone = threading.Event()
        self._gone_unix_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="spotrun-supervisor-watch", daemon=True)
        self._thread.start()

    @property
    def gone(self) -> bool:
        """Whether the supervisor has exited."""
        return self._gone.is_set()

    @property
    def end_unix_s(self) -> float | None:
        """When this process will be killed (seconds since the epoch); ``None`` while the supervisor runs."""
        return None if self._gone_unix_s is None else self._gone_unix_s + self.grace_period_s

    def wait_gone(self, timeout_s: float | None = None) -> bool:
        """Block until the supervisor is gone or ``timeout_s`` passed; whether it is gone."""
        return self._gone.wait(timeout_s)

    def _run(self) -> None:
        self._wait_for_exit()
        self._gone_unix_s = time.time()
        self._gone.set()
        log.warning(
            "the supervisor (pid %d) is gone: stopping at the next step boundary with an emergency "
            "checkpoint; this process ends itself in %.1f s at the latest",
            self.supervisor_pid,
            self.grace_period_s,
        )
        time.sleep(self.grace_period_s)
        log.error(
            "still running %.1f s after the supervisor (pid %d) died: killing this process (pid %d)",
            self.grace_period_s,
            self.supervisor_pid,
            os.getpid(),
        )
        for handler in logging.getLogger().handlers + logging.getLogger("spotrun").handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - nothing may stop the kill
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def _wait_for_exit(self) -> None:
        if self._pidfd is not None:
            poller = select.poll()  # not select(): fds above 1024 are common in big workers
            poller.register(self._pidfd, select.POLLIN)
            while not poller.poll():  # readable once the process has exited
                pass
            os.close(self._pidfd)
            return
        while is_ancestor(self.supervisor_pid):
            time.sleep(POLL_S)


def watch(env: WorkerEnv) -> SupervisorWatch | None:
    """The watch of this process's supervisor, started at the first call (one per process).

    Returns:
        ``None`` when no supervisor is named (``$SPOTRUN_SUPERVISOR_PID`` unset: the script
        runs without ``spotrun run``) or when the named process is not an ancestor of this
        one (logged: another PID namespace, a launcher outside the supervisor's tree, or a
        supervisor already gone; the kernel's SIGTERM to the launcher still applies).
    """
    if env.supervisor_pid is None:
        return None
    with _lock:
        me = os.getpid()  # a forked child (a DataLoader worker) gets none of its parent's threads
        if me not in _watches:
            _watches[me] = _start(env.supervisor_pid, env.grace_period_s or DEFAULT_GRACE_PERIOD_S)
        return _watches[me]


def _start(pid: int, grace_period_s: float) -> SupervisorWatch | None:
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError) as exc:  # no pidfd (old kernel, not Linux) or no such process
        log.debug("no pidfd for the supervisor (pid %d): %s", pid, exc)
    # Checked after opening: an ancestor alive now held this pid when the pidfd was opened.
    if not is_ancestor(pid):
        if pidfd is not None:
            os.close(pidfd)
        log.warning(
            "the supervisor named by $SPOTRUN_SUPERVISOR_PID (pid %d) is not an ancestor of this "
            "process (pid %d): not watching it",
            pid,
            os.getpid(),
        )
        return None
    return SupervisorWatch(pid, grace_period_s, pidfd)


def is_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process's parent, grandparent, ... (read from ``/proc``)."""
    current = os.getppid()
    for _ in range(4096):  # a cycle is impossible; the bound only guards against bad /proc data
        if current == pid:
            return True
        if current <= 1:
            return current == pid
        current = _parent_of(current)
        if current is None:
            return False
    return False


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
        return int(text[text.rfind(")") + 2 :].split()[1])
    except (OSError, IndexError, ValueError):
        return None
