"""The saves of one Checkpointer: a save now, a due save (periodic, or a checkpoint the supervisor
asked for) while training goes on, and acting on the outcome of background saves (a failure
counts as a failed periodic save).

:class:`Saves` owns the background saver, the newest saved step and the failed periodic saves in
a row; when a save is due is :func:`spotrun.train.decision.decide`'s answer, and what becomes of
a save in flight when the job stops is :meth:`Saves.settle` (:mod:`spotrun.checkpoint.in_flight`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from spotrun.checkpoint.background import BackgroundSaver, InFlightSave, settle
from spotrun.checkpoint.retention import Retainer, RetentionPolicy
from spotrun.checkpoint.save import SaveContext, save_step
from spotrun.checkpoint.save_bounds import collectives_deadline_s
from spotrun.checkpoint.shard import ShardLimits
from spotrun.control.env import DEFAULT_AGREEMENT_TIMEOUT_S, WorkerEnv
from spotrun.errors import CheckpointSaveError, SaveAbortedError
from spotrun.state.stateful import state_of
from spotrun.storage import Storage
from spotrun.tools import dist
from spotrun.tools.gc_pause import gc_paused
from spotrun.train.hang_report import report_collective_timeout
from spotrun.train.identity import Identity
from spotrun.train.meter import SaveMeter
from spotrun.train.options import CheckpointerOptions

log = logging.getLogger("spotrun.checkpointer")  # the Checkpointer's log lines, as they always were


class Saves:
    """Writes the checkpoints of one Checkpointer and keeps what they left behind.

    Args:
        options: the Checkpointer's settings (``background_saves``, ``on_save_in_flight``,
            ``save_timeout_s``, ``max_failed_periodic_saves`` are read at each save).
        env: this worker's environment (retention set by ``spotrun run``).
        storage, meter, identity: where the steps go, the step and save timings, the run id and
            incarnation the saves record (a first save claims it).
        state, rank_state: the Checkpointer's objects, read at each save.
        name: what the log calls these saves when one is abandoned (the fast tier's: ``"fast-tier save"``).
    """

    def __init__(
        self,
        options: CheckpointerOptions,
        env: WorkerEnv,
        storage: Storage,
        meter: SaveMeter,
        identity: Identity,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        *,
        name: str = "background save",
    ) -> None:
        self.options = options
        self.name = name
        self.saver = BackgroundSaver(
            meter, after_commit=self._retain, on_collective_timeout=partial(report_collective_timeout, env.control_dir)
        )
        self._storage = storage
        self._limits = ShardLimits(
            max_file_size_bytes=options.max_file_size_bytes, max_header_bytes=options.max_header_bytes
        )
        self._meter = meter
        self._identity = identity
        self._state = state
        self._rank_state = rank_state
        self._retainer = Retainer(
            storage,
            RetentionPolicy.for_worker(options.keep_last, options.keep_every, env.keep_last, env.keep_every),
            timeout_s=options.save_timeout_s,
        )
        self._last_saved_step: int | None = None  # written by saved() only
        self._failed_in_a_row = 0

    @property
    def last_saved_step(self) -> int | None:
        """The newest step saved (committed and reported) or restored, if any."""
        return self._last_saved_step

    @property
    def last_committed_step(self) -> int | None:
        """As :attr:`last_saved_step`, counting the background save in flight once it committed."""
        current = self.saver.in_flight
        if current is not None and current.committed:
            return max(current.step, self._last_saved_step or 0)
        return self._last_saved_step

    def saved(self, step: int) -> None:
        """``step`` was committed (or restored): the newest saved step, which a due save skips."""
        self._last_saved_step = step

    @gc_paused()
    def save_now(self, step: int, reason: str, timeout_s: float | None = None) -> None:
        """:meth:`spotrun.train.checkpointer.Checkpointer.save`: wait for the save in flight,
        then save and commit ``step`` synchronously, unless it is the newest saved step."""
        if self.saver.in_flight is not None:
            self.report(self.saver.take())
        if self._last_saved_step == step:
            return
        started_s = self._meter.save_started(step, reason)
        timeout_s = self.options.save_timeout_s if timeout_s is None else timeout_s
        try:
            replicated, rank_local = self._state_dicts()
            until_s = collectives_deadline_s(timeout_s)
            with self._storage.deadline(timeout_s):
                context = self._context_of(step, reason, replicated, rank_local, until_s)
                done = save_step(
                    self._storage, step, replicated, rank_local, context, self._limits, collective_deadline_s=until_s
                )
        except BaseException:
            self._meter.save_ended(step, reason, started_s, None)
            raise
        self.saved(step)
        duration_s = self._meter.save_ended(step, reason, started_s, done.size_bytes)
        if done.manifest is not None:
            log.info(
                "committed step %d (%s): %d files, %.1f MiB in %.2f s",
                step,
                reason,
                len(done.manifest.files),
                done.size_bytes / 2**20,
                duration_s,
            )
        self._retain(step, reason)

    def due(
        self,
        step: int,
        reason: str,
        still_running: bool | None,
        *,
        before_write: Callable[[], None] | None = None,
    ) -> bool:
        """A due save (periodic, or requested by the supervisor); False when skipped because
        the save before it is still in flight (``on_save_in_flight="skip"``).

        ``still_running``: whether some rank still writes the save in flight, if this step's
        all-reduce already asked; else one all-reduce asks here. ``before_write``: run before the
        save writes (:meth:`~spotrun.checkpoint.background.BackgroundSaver.start`; a save now runs it here).
        """
        if self._last_saved_step == step:
            return True
        if not self.options.background_saves:
            try:
                if before_write is not None:
                    before_write()
                self.save_now(step, reason)
                self._failed_in_a_row = 0
            except CheckpointSaveError as exc:
                self._count_failure(step, exc)
            return True
        if still_running is None:  # this step's all-reduce did not ask: one all-reduce at a due step
            still_running = dist.any_rank(
                self.saver.running,
                timeout_s=self.options.agreement_timeout_s or DEFAULT_AGREEMENT_TIMEOUT_S,
                what=f"the look for a save in flight at step {step}",
            )
        if still_running and self.options.on_save_in_flight == "skip":
            if dist.rank() == 0:
                log.warning(
                    "%s save of step %d skipped: the background save of step %s is still in flight "
                    "(on_save_in_flight='skip')%s",
                    reason,
                    step,
                    self.saver.in_flight.step if self.saver.in_flight else "?",
                    "; the request is served at a later step" if reason == "requested" else "",
                )
            return False
        waited_s = self.saver.wait_reporting(f"{reason} save of step {step}") if still_running else 0.0
        self.report(self.saver.take())
        replicated, rank_local = self._state_dicts()
        try:  # staged here; claiming the incarnation (a save without restore()) also happens here
            self.saver.start(
                self._storage,
                step,
                replicated,
                rank_local,
                lambda: self._context_of(
                    step,
                    reason,
                    replicated,
                    rank_local,
                    collectives_deadline_s(self.options.save_timeout_s),
                ),
                self._limits,
                timeout_s=self.options.save_timeout_s,
                reason=reason,
                waited_s=waited_s,
                before_write=before_write,
            )
        except CheckpointSaveError as exc:
            self._count_failure(step, exc)
        return True

    def report(self, ended: InFlightSave | None, *, count_failure: bool = True) -> None:
        """Act on the outcome of a background save that ended (the same step on every rank):
        a commit is the newest saved step; a failure counts as a failed periodic save (or
        raises, see ``end_of_step``); an abandoned save (on purpose) is only logged."""
        if ended is None:
            return
        if ended.error is None:
            self.saved(ended.step)
            self._failed_in_a_row = 0
            return
        if isinstance(ended.error, SaveAbortedError):
            if dist.rank() == 0:
                log.warning("%s of step %d abandoned: nothing of it was committed", self.name, ended.step)
            return
        if not isinstance(ended.error, CheckpointSaveError) or not count_failure:
            raise ended.error
        self._count_failure(ended.step, ended.error)

    def settle(self, step: int, timeout_s: float, *, may_save: bool) -> tuple[bool, float]:
        """Finish or abandon the background save in flight before the job stops (collective);
        returns (whether to save ``step`` now, the seconds left for that save)."""
        end_s = time.monotonic() + timeout_s
        choice, ended = settle(
            self.saver, step=step, left_s=timeout_s, full_save_s=self._meter.full_save_s(), may_save=may_save
        )
        try:
            self.report(ended)
        except CheckpointSaveError as exc:  # it failed: stopping anyway, saving this step if chosen
            if not exc.retryable:
                raise
        return choice.saves_current_step, end_s - time.monotonic()

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the replicated state, this rank's own state) as state dicts of the live objects."""
        return (
            {name: state_of(obj) for name, obj in self._state.items()},
            {name: state_of(obj) for name, obj in self._rank_state.items()},
        )

    def _context_of(
        self, step: int, reason: str, replicated: dict[str, Any], rank_local: dict[str, Any], until_s: float
    ) -> SaveContext:
        """The save's context; a first save claims the incarnation, its broadcast giving up at ``until_s``."""
        return self._identity.save_context(step, reason, replicated, rank_local, self._meter.step_time_s, until_s)

    def _retain(self, step: int, reason: str) -> None:  # on global rank 0; an emergency save's grace is the save's
        if dist.rank() == 0 and reason != "emergency":
            self._retainer.after_commit(step, self._identity.incarnation)

    def _count_failure(self, step: int, exc: CheckpointSaveError) -> None:
        if not exc.retryable:  # a newer start owns the root, or the store cannot commit
            raise exc
        self._failed_in_a_row += 1
        failed = "periodic save" if self.name == "background save" else self.name
        log.error("%s of step %d failed (%d in a row): %s", failed, step, self._failed_in_a_row, exc)
        if self._failed_in_a_row > self.options.max_failed_periodic_saves:
            raise exc
