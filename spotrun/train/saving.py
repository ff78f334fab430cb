"""Due saves - periodic, or a checkpoint the supervisor asked for - while training goes on, and
acting on the outcome of background saves (a failure counts as a failed periodic save).

A mixin of :class:`spotrun.train.checkpointer.Checkpointer`; when a save is due is
:func:`spotrun.train.decision.decide`'s answer.
"""

from __future__ import annotations

import logging

from spotrun.tools import dist
from spotrun.checkpoint.background import InFlightSave
from spotrun.errors import CheckpointSaveError, SaveAbortedError

log = logging.getLogger("spotrun.checkpointer")


class PeriodicSavingMixin:
    """The Checkpointer's due saves (uses its background saver, state, storage, ``save`` and
    ``_context``)."""

    def _due_save(self, step: int, reason: str, still_running: bool | None) -> bool:
        """A due save (periodic, or requested by the supervisor); False when skipped because
        the save before it is still in flight (``on_save_in_flight="skip"``).

        ``still_running``: whether some rank still writes the save in flight, if this step's
        all-reduce already asked; else one all-reduce asks here.
        """
        if self._last_saved_step == step:
            return True
        if not self.background_saves:
            try:
                self.save(step, reason=reason)
                self._failed_periodic_saves = 0
            except CheckpointSaveError as exc:
                self._count_failed_periodic_save(step, exc)
            return True
        if still_running is None:  # this step's all-reduce did not ask: one all-reduce at a due step
            still_running = dist.any_rank(self._background.running)
        if still_running and self.on_save_in_flight == "skip":
            if dist.rank() == 0:
                log.warning("%s save of step %d skipped: the background save of step %s is still in flight "
                            "(on_save_in_flight='skip')%s", reason, step, self._background.in_flight.step
                            if self._background.in_flight else "?",
                            "; the request is served at a later step" if reason == "requested" else "")
            return False
        waited_s = self._background.wait_reporting(f"{reason} save of step {step}") if still_running else 0.0
        self._report_background(self._background.take())
        replicated, rank_local = self._state_dicts()
        try:  # staged here; claiming the incarnation (a save without restore()) also happens here
            self._background.start(self._storage, step, replicated, rank_local,
                                   lambda: self._context(step, reason, replicated, rank_local), self._limits,
                                   timeout_s=self.save_timeout_s, reason=reason, waited_s=waited_s)
        except CheckpointSaveError as exc:
            self._count_failed_periodic_save(step, exc)
        return True

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
