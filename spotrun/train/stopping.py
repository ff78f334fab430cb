"""Stopping the job: the emergency checkpoint at an agreed step, or a stop without one, and
what happens to a background save in flight then (:mod:`spotrun.checkpoint.in_flight`).

A mixin of :class:`spotrun.train.checkpointer.Checkpointer`, kept apart from the periodic saving.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from spotrun.control import files as control
from spotrun.tools import dist
from spotrun.checkpoint.background import settle
from spotrun.errors import CheckpointSaveError
from spotrun.train.requests import Asked

log = logging.getLogger("spotrun.checkpointer")


class StoppingMixin:
    """The Checkpointer's stop paths (uses its requests, meter, background saver, env,
    ``save`` and ``_report_background``)."""

    def _emergency_save(self, step: int, asked: Asked, why: str | None = None) -> None:
        """Save ``step`` and stop (collective); ``asked``: this rank's requests as read at
        this step (they bound the save's time), ``why``: who asked when they do not say."""
        if dist.rank() == 0:
            log.warning("save requested (%s): emergency checkpoint of step %d", why or asked.describe(), step)
        # A dying DataLoader worker sends SIGCHLD, whose torch handler raises in this
        # thread; keep it from aborting the save. The process exits right after.
        previous_mask = None
        if threading.current_thread() is threading.main_thread():
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            save = True
            timeout_s = self._requests.emergency_timeout_s(asked, self.save_timeout_s)
            if self.background_saves:
                save, timeout_s = self._settle_in_flight(step, timeout_s, may_save=True)
            if save and self._last_saved_step != step:
                self.save(step, reason="emergency", timeout_s=timeout_s)
        except BaseException:
            if previous_mask is not None:  # the process goes on (or unwinds): give SIGCHLD back
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            raise
        self.preempted = True
        self._events.stopped(step, saved=save)
        if self._env.control_dir and dist.local_rank() == 0:
            if save:
                control.write_commit_report(self._env.control_dir, step)
            else:  # this step is lost; the save that was in flight (if it committed) is the resume point
                control.write_stop_report(self._env.control_dir, step)

    def _settle_in_flight(self, step: int, timeout_s: float, *, may_save: bool) -> tuple[bool, float]:
        """Finish or abandon the background save in flight before the job stops (collective);
        returns (whether to save ``step`` now, the seconds left for that save)."""
        end_s = time.monotonic() + timeout_s
        choice, ended = settle(self._background, step=step, left_s=timeout_s,
                                         full_save_s=self._meter.full_save_s(), may_save=may_save)
        try:
            self._report_background(ended)
        except CheckpointSaveError as exc:  # it failed: stopping anyway, saving this step if chosen
            if not exc.retryable:
                raise
        return choice.saves_current_step, end_s - time.monotonic()

    def _stop_without_save(self, step: int, asked: Asked) -> None:
        if self.background_saves:
            self._settle_in_flight(step, self._requests.emergency_timeout_s(asked, self.save_timeout_s),
                                   may_save=False)
        if dist.rank() == 0:
            log.warning(
                "stop requested without a save (%s): stopping after step %d; the newest complete "
                "checkpoint (step %s here) stays the resume point",
                asked.describe(), step, self._last_saved_step,
            )
        self.preempted = True
        self._events.stopped(step, saved=False)
        if self._env.control_dir and dist.local_rank() == 0:
            control.write_stop_report(self._env.control_dir, step)
