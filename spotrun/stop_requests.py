"""What a worker was asked to do about stopping, and by when.

A rank is asked to stop by a signal to itself (SIGTERM, SIGINT), by its supervisor's request
file (:mod:`spotrun.control`: save and stop, or stop without saving), or by a supervisor
that is gone (:mod:`spotrun.supervisor_watch`). :class:`StopRequests` gathers these for the
:class:`~spotrun.checkpointer.Checkpointer`, which turns them into one decision of all ranks
at a step boundary, and says how long an emergency save may take.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from spotrun import control, supervisor_watch
from spotrun.env import WorkerEnv, default_safety_margin_s
from spotrun.errors import ConfigError

log = logging.getLogger(__name__)

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """The stop requests of this rank (one per :class:`~spotrun.checkpointer.Checkpointer`).

    Args:
        env: the worker's environment (control directory, supervisor).
        handle_signals: turn SIGTERM/SIGINT into a request (main thread only); a second
            SIGINT interrupts as usual.
    """

    def __init__(self, env: WorkerEnv, *, handle_signals: bool) -> None:
        self._env = env
        self.signal_name: str | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._owner_pid = os.getpid()
        # Under `spotrun run`: a supervisor that dies (even by SIGKILL) is a stop request, and
        # this process ends itself a grace period later at the latest (spotrun.supervisor_watch).
        self._supervisor = supervisor_watch.watch(env)
        if handle_signals:
            self._install_signal_handlers()

    def pending(self) -> tuple[bool, bool]:
        """(save and stop, stop without saving) as asked of this rank: a signal or the
        supervisor's request file (one ``stat`` per call while there is none)."""
        if self._env.control_dir and control.save_requested(self._env.control_dir):
            try:
                request = control.read_save_request(self._env.control_dir)
            except ConfigError as exc:  # half-visible or damaged: saving is the safe reading
                log.warning("%s; taking it as a save request", exc)
                request = None
            if request is not None and not request.save:
                return False, True
            return True, False
        supervisor_gone = self._supervisor is not None and self._supervisor.gone
        return self.signal_name is not None or supervisor_gone, False

    def emergency_timeout_s(self, save_timeout_s: float) -> float:
        """Seconds an emergency save may take: ``save_timeout_s``, or less when the
        supervisor's request names an earlier deadline, or when the supervisor is gone (the
        save must end a safety margin before this process is killed)."""
        timeout_s = save_timeout_s
        request = control.read_save_request(self._env.control_dir) if self._env.control_dir else None
        if request is not None and request.deadline_unix_s is not None:
            timeout_s = min(timeout_s, request.deadline_unix_s - time.time())
        end_unix_s = self._supervisor.end_unix_s if self._supervisor is not None else None
        if end_unix_s is not None:
            margin_s = default_safety_margin_s(self._supervisor.grace_period_s)
            timeout_s = min(timeout_s, end_unix_s - margin_s - time.time())
        return timeout_s

    def describe(self) -> str:
        """Who asked, for the log (``"SIGTERM"``, ``"supervisor: SIGTERM"``, ``"another rank"``)."""
        if self.signal_name:
            return self.signal_name
        if self._env.control_dir:
            request = control.read_save_request(self._env.control_dir)
            if request is not None:
                return f"supervisor: {request.reason}"
        if self._supervisor is not None and self._supervisor.gone:
            return f"the supervisor (pid {self._supervisor.supervisor_pid}) is gone"
        return "another rank"

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Checkpointer created outside the main thread: signals not handled")
            return
        for signum in _HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked DataLoader worker: keep serving batches, the parent decides
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt
        self.signal_name = name

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were in place before (main thread)."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
