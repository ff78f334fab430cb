"""Stopping the job - the emergency checkpoint at an agreed step, or a stop without one, and
what happens to a background save in flight then (:mod:`spotrun.checkpoint.in_flight`) - and
acting on the outcome of a background save.

A mixin of :class:`spotrun.checkpointer.Checkpointer`, kept apart from the periodic saving.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from spotrun import control, dist
from spotrun.checkpoint.background import InFlightSave, settle
from spotrun.errors import CheckpointSaveError, SaveAbortedError

log = logging.getLogger("spotrun.checkpointer")


class StoppingMixin:
    """The Checkpointer's stop paths (uses its requests, meter, background saver, env and
    ``save``)."""

    def _emergency_save(self, step: int, why: str | None = None) -> None:
        if dist.rank() == 0:
            log.warning("save requested (%s): emergency checkpoint of step %d",
                        why or self._requests.describe(), step)
        # A dying DataLoader worker sends SIGCHLD, whose torch handler raises in this
        # thread; keep it from aborting the save. The process exits right after.
        previous_mask = None
        if threading.current_thread() is threading.main_thread():
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            save = True
            timeout_s = self._requests.emergency_timeout_s(self.save_timeout_s)
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

    def _stop_without_save(self, step: int) -> None:
        if self.background_saves:
            self._settle_in_flight(step, self._requests.emergency_timeout_s(self.save_timeout_s), may_save=False)
        if dist.rank() == 0:
            log.warning(
                "stop requested without a save (%s): stopping after step %d; the newest complete "
                "checkpoint (step %s here) stays the resume point",
                self._requests.describe(), step, self._last_saved_step,
            )
        self.preempted = True
        self._events.stopped(step, saved=False)
        if self._env.control_dir and dist.local_rank() == 0:
            control.write_stop_report(self._env.control_dir, step)

    def _stop_step_reached(self, step: int) -> bool:
        """Whether ``$SPOTRUN_STOP_AT_STEP`` asks to stop at ``step`` (``step >=`` it).

        Every rank reads the same variable and is at the same step, so the ranks agree
        without a collective.
        """
        return self._env.stop_at_step is not None and step >= self._env.stop_at_step

    def _report_background(self, ended: InFlightSave | None, *, count_failure: bool = True) -> None:
        """Act on the outcome of a background save that ended (the same step on every rank):
        a commit is the newest saved step; a failure counts as a failed periodic save (or
        raises, see :meth:`end_of_step`); an abandoned save (on purpose) is only logged."""
        if ended is None:
            return
        if ended.error is None:
            self._last_saved_step = ended.step
            self._failed_periodic_saves = 0
            return
        if isinstance(ended.error, SaveAbortedError):
            if dist.rank() == 0:
                log.warning("background save of step %d abandoned: nothing of it was committed", ended.step)
            return
        if not isinstance(ended.error, CheckpointSaveError) or not count_failure:
            raise ended.error
        self._count_failed_periodic_save(ended.step, ended.error)

    def _count_failed_periodic_save(self, step: int, exc: CheckpointSaveError) -> None:
        if not exc.retryable:  # a newer start owns the root, or the store cannot commit
            raise exc
        self._failed_periodic_saves += 1
        log.error("periodic save of step %d failed (%d in a row): %s", step, self._failed_periodic_saves, exc)
        if self._failed_periodic_saves > self.max_failed_periodic_saves:
            raise exc
