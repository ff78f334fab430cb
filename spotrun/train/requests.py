"""What a worker was asked to do about stopping, and by when.

A rank is asked to stop by a signal to itself (SIGTERM, SIGINT), by its supervisor's request
file (:mod:`spotrun.control.files`: save and stop, or stop without saving), or by a supervisor
that is gone (:mod:`spotrun.train.supervisor_watch`). :meth:`StopRequests.read` gathers these once
per look into an :class:`Asked`, from which the :class:`~spotrun.train.checkpointer.Checkpointer`
makes one decision of all ranks at a step boundary (:mod:`spotrun.train.decision`) and bounds
its emergency save.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from spotrun.control import files as control
from spotrun.control.env import WorkerEnv, default_safety_margin_s
from spotrun.errors import ConfigError
from spotrun.tools import process_local
from spotrun.train import decision as save_decision
from spotrun.train import supervisor_watch

log = logging.getLogger(__name__)

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Asked:
    """What one rank was asked at one look (:meth:`StopRequests.read`).

    Attributes:
        request: the supervisor's request file as read then (a damaged one reads as a save
            request without a deadline); ``None``: there was none.
        signal_name: the signal this process got (``"SIGTERM"``), if any.
        gone_supervisor_pid: the pid of the supervisor, if it had exited.
    """

    request: control.SaveRequest | None = None
    signal_name: str | None = None
    gone_supervisor_pid: int | None = None

    @property
    def stop_without_save(self) -> bool:
        """The supervisor asked to stop without a save (it outranks a signal)."""
        return self.request is not None and not self.request.save

    @property
    def save_and_stop(self) -> bool:
        """Asked for an emergency checkpoint: by the supervisor's request, else by a signal
        or a supervisor that is gone."""
        if self.request is not None:
            return self.request.save
        return self.signal_name is not None or self.gone_supervisor_pid is not None

    @property
    def save_to_memory(self) -> bool:
        """The supervisor asked for the emergency checkpoint in the fast tier, copied to another
        node (a save to storage would not commit before the deadline)."""
        return self.request is not None and self.request.save and self.request.tier == "memory"

    def describe(self) -> str:
        """Who asked, for the log (``"SIGTERM"``, ``"supervisor: SIGTERM"``, ``"another rank"``)."""
        if self.signal_name:
            return self.signal_name
        if self.request is not None:
            return f"supervisor: {self.request.reason}"
        if self.gone_supervisor_pid is not None:
            return f"the supervisor (pid {self.gone_supervisor_pid}) is gone"
        return "another rank"


class StopRequests:
    """The stop requests of this rank (one per :class:`~spotrun.train.checkpointer.Checkpointer`).

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
        # this process ends itself a grace period later at the latest (spotrun.train.supervisor_watch).
        self._supervisor = supervisor_watch.watch(env)
        if handle_signals:
            self._install_signal_handlers()

    def read(self) -> Asked:
        """What this rank is asked now: the supervisor's request file read once (one
        ``stat`` while there is none), the signal, the supervisor watch."""
        request = None
        if self._env.control_dir and control.save_requested(self._env.control_dir):
            try:
                request = control.read_save_request(self._env.control_dir)
            except ConfigError as exc:  # damaged: saving is the safe reading
                log.warning("%s; taking it as a save request", exc)
                request = control.SaveRequest(
                    reason="unreadable request file", requested_unix_s=time.time(), deadline_unix_s=None
                )
        gone = self._supervisor is not None and self._supervisor.gone
        return Asked(
            request=request,
            signal_name=self.signal_name,
            gone_supervisor_pid=self._supervisor.supervisor_pid if gone else None,
        )

    def emergency_timeout_s(self, asked: Asked, save_timeout_s: float) -> float:
        """Seconds an emergency save may take (:func:`spotrun.train.decision.emergency_timeout_s`):
        at most ``save_timeout_s``, bounded by the deadline of the request in ``asked`` and,
        when the supervisor is gone, by the time this process will be killed."""
        watch = self._supervisor
        kill_unix_s = watch.end_unix_s if watch is not None else None
        request = asked.request
        if request is None and self._env.control_dir:
            # This rank looked before its supervisor's request appeared, and another rank's
            # request won the agreement: read it now (the stop path only), or this rank's save
            # would not be bounded by the deadline the others keep.
            try:
                request = control.read_save_request(self._env.control_dir)
            except ConfigError as exc:
                log.warning("%s; saving without its deadline", exc)
        return save_decision.emergency_timeout_s(
            save_timeout_s,
            time.time(),
            deadline_unix_s=request.deadline_unix_s if request is not None else None,
            kill_unix_s=kill_unix_s,
            safety_margin_s=0.0 if kill_unix_s is None else default_safety_margin_s(watch.grace_period_s),
        )

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Checkpointer created outside the main thread: signals not handled")
            return
        for signum in _HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        # A forked child (a loader or pool worker) gets back the handlers it would have had
        # without spotrun: Pool.terminate()'s SIGTERM must end a pool worker (spotrun.tools.process_local).
        process_local.in_forked_children(
            StopRequests.restore_signal_handlers, self, held_signals=frozenset(_HANDLED_SIGNALS)
        )

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner_pid:
            return  # a child forked without the at-fork hooks (by C code): the parent decides
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt
        self.signal_name = name

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were in place before (main thread)."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
