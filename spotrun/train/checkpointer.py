"""The training-loop API: periodic and emergency checkpoints, and exact resume.

Typical use inside a ``torchrun`` worker (see the README for the whole loop)::

    ckpt = spotrun.Checkpointer(
        state={"model": model, "optimizer": opt, "scheduler": sched, "data": loader},
        interval_steps=100,
    )
    step = ckpt.restore()              # 0 on a fresh start
    ...
        step += 1
        if ckpt.end_of_step(step):     # True: stop now (an emergency checkpoint committed,
            return                     # unless the supervisor found no time for one)

"When to save" (:mod:`spotrun.train.decision`, a pure function :meth:`Checkpointer.end_of_step`
acts on) is kept apart from "how to save" (:mod:`spotrun.checkpoint.save`; in the background:
:mod:`spotrun.checkpoint.background`, and what happens to a save in flight when the job must
stop: :mod:`spotrun.checkpoint.in_flight`). Three mixins hold parts of the class: :meth:`Checkpointer.restore`
(:mod:`spotrun.train.restoring`), due saves (:mod:`spotrun.train.saving`), stops (:mod:`spotrun.train.stopping`).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace
from typing import Any

from spotrun.control import files as control
from spotrun.tools import dist
from spotrun.control import listeners
from spotrun.checkpoint.background import BackgroundSaver
from spotrun.checkpoint.claim import claim_incarnation
from spotrun.checkpoint.retention import Retainer, RetentionPolicy
from spotrun.checkpoint.encode import encode_state
from spotrun.checkpoint.save import SaveContext, save_step
from spotrun.train.fence_report import report_fenced, reports_fence
from spotrun.checkpoint.shard import DEFAULT_MAX_FILE_SIZE_BYTES, DEFAULT_MAX_HEADER_BYTES, ShardLimits
from spotrun.tools.gc_pause import gc_paused
from spotrun.control.env import DEFAULT_CHECKPOINT_URI, DEFAULT_SAVE_TIMEOUT_S, WorkerEnv
from spotrun.train.decision import Action, StepContext, decide
from spotrun.train.meter import SaveMeter
from spotrun.errors import ConfigError, FencedError
from spotrun.state.numerics import NUMERICS_STATE_NAME, NumericsState
from spotrun.state.optimizer import pair_optimizers
from spotrun.state.rng import RNGState
from spotrun.state.stateful import state_of
from spotrun.train.requests import StopRequests
from spotrun.train.restoring import RestoringMixin
from spotrun.train.saving import PeriodicSavingMixin
from spotrun.train.stopping import StoppingMixin
from spotrun.train.events import TrainingEvents
from spotrun.storage import Storage, open_storage

log = logging.getLogger("spotrun.checkpointer")  # the name its log lines always had, for filters

#: What a due save does while the previous background save is still in flight.
ON_SAVE_IN_FLIGHT = ("wait", "skip")


class Checkpointer(RestoringMixin, PeriodicSavingMixin, StoppingMixin):
    """Saves and restores the whole training state of every rank.

    Args:
        state: name -> object to checkpoint. Objects with ``state_dict()`` /
            ``load_state_dict()`` (model, optimizer, LR scheduler, gradient scaler,
            :class:`spotrun.data.loader.ResumableDataLoader`) or plain dicts of tensors and
            JSON values. Plain tensors must be identical on every rank (DDP replicas):
            they are written once in total, spread over the ranks by bytes. DTensors
            (FSDP2, tensor parallel, HSDP) are written by the ranks that hold them, each
            chunk once, and load into any layout (:mod:`spotrun.checkpoint.sharded`). An
            optimizer whose parameters belong to a module in ``state`` is saved keyed by
            parameter name (:mod:`spotrun.state.optimizer`).
        uri: checkpoint root; default ``$SPOTRUN_CHECKPOINT_URI``, else ``./checkpoints``.
        interval_steps: save every this many steps in :meth:`end_of_step`; 0 = never.
        rank_state: name -> object whose state differs per rank (saved by each rank).
            Every rank's RNGs (Python, NumPy, torch CPU, each CUDA device) are always saved,
            and the settings that decide its arithmetic (intra-op threads, torch version, CPU
            capability, GPU models; :mod:`spotrun.state.numerics`): a restore logs a warning
            when they differ from the writer's. Names ``rng`` and ``numerics`` are reserved.
        check_interval_steps: look for a save request every this many steps (1 = every
            step; each check is one all-reduce of a few flags).
        handle_signals: turn SIGTERM/SIGINT into an emergency-save request (main thread
            only). A second SIGINT interrupts as usual.
        max_failed_periodic_saves: consecutive failed periodic saves tolerated (logged)
            before :meth:`end_of_step` raises.
        storage: a ready storage backend (overrides ``uri``; for tests and embedding).
        save_timeout_s: most seconds the storage operations of one save may take, retries
            included; when storage keeps failing the save fails after at most this long.
            An emergency save requested by the supervisor gets the smaller of this and the
            time left until the request's ``deadline_unix_s``.
        max_file_size_bytes: most bytes of one shard file (default 4 GiB); a rank whose
            tensors would pass it writes several files (a single larger tensor gets a file of
            its own). Files are streamed: a save holds a bounded buffer, not a file.
        max_header_bytes: most bytes of one shard file's safetensors header (default
            16 MiB; at most safetensors' limit of 100 MB, about a million small tensors);
            a rank with more tensors writes several files.
        background_saves: periodic and supervisor-requested saves copy the state into
            staging buffers (host memory allocated once and reused, pinned for GPU tensors)
            and return; the write, checksums, upload and commit run on a background thread
            while training goes on. At most one save is in flight. A failed background save
            is reported at the first :meth:`end_of_step` after it ended on every rank (at a
            step that looks for requests, or at the next due save) and counts as a failed
            periodic save. False: every save blocks training until it committed.
            :meth:`save` and emergency saves are always synchronous.
        on_save_in_flight: what a due save does while the previous background save is still
            in flight on some rank: ``"wait"`` (for it, logging how long) or ``"skip"`` (this
            save is skipped, with a log line; a supervisor-requested checkpoint is taken at a
            later step instead).
        event_interval_s: rank 0's event log (``events/`` under the root, :mod:`spotrun.train.events`)
            writes the newest step at most every this many seconds (default ``$SPOTRUN_EVENT_INTERVAL_S``, else 30).
        keep_last, keep_every: retention after each commit: keep the ``keep_last`` newest complete
            steps and those divisible by ``keep_every`` (:mod:`spotrun.checkpoint.retention`); ``None``:
            ``$SPOTRUN_KEEP_LAST``/``_EVERY`` (``spotrun run --keep-last``), else (or 0) keep every step.

    Raises:
        ConfigError: bad arguments or environment.
    """

    def __init__(
        self,
        state: dict[str, Any],
        *,
        uri: str | None = None,
        interval_steps: int = 0,
        rank_state: dict[str, Any] | None = None,
        check_interval_steps: int = 1,
        handle_signals: bool = True,
        max_failed_periodic_saves: int = 3,
        storage: Storage | None = None,
        save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
        max_file_size_bytes: int = DEFAULT_MAX_FILE_SIZE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        background_saves: bool = True,
        on_save_in_flight: str = "wait",
        event_interval_s: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
    ) -> None:
        if not isinstance(state, dict) or not state:
            raise ConfigError("Checkpointer(state=...) needs a non-empty dict of name -> object")
        for reserved in ("rng", NUMERICS_STATE_NAME):
            if reserved in (rank_state or {}):
                raise ConfigError(f"rank_state name {reserved!r} is reserved for the state spotrun saves itself")
        if interval_steps < 0 or check_interval_steps < 1:
            raise ConfigError("interval_steps must be >= 0 and check_interval_steps >= 1")
        if not save_timeout_s > 0:
            raise ConfigError(f"save_timeout_s must be > 0, got {save_timeout_s}")
        if on_save_in_flight not in ON_SAVE_IN_FLIGHT:
            raise ConfigError(f"on_save_in_flight must be one of {ON_SAVE_IN_FLIGHT}, got {on_save_in_flight!r}")
        self._limits = ShardLimits(max_file_size_bytes=max_file_size_bytes, max_header_bytes=max_header_bytes)
        # optimizers keyed by parameter name (DCP's state_dict helpers): any layout loads them
        self._state = pair_optimizers(dict(state))
        self._rank_state = {**(rank_state or {}), NUMERICS_STATE_NAME: NumericsState(), "rng": RNGState()}
        self._env = WorkerEnv.from_environ()
        # Under `spotrun run`: say that this worker reads the save request, so the supervisor
        # sends it no signal (spotrun.supervisor.foreign); first, before a long restore.
        listeners.announce("checkpointer")
        self._storage = storage or open_storage(uri or self._env.checkpoint_uri or DEFAULT_CHECKPOINT_URI)
        self.interval_steps = interval_steps
        self.check_interval_steps = check_interval_steps
        self.max_failed_periodic_saves = max_failed_periodic_saves
        self.save_timeout_s = save_timeout_s
        self.background_saves = background_saves
        self.on_save_in_flight = on_save_in_flight
        self._run_id = self._env.run_id or uuid.uuid4().hex
        self._last_saved_step: int | None = None
        self._incarnation: int | None = None  # claimed by restore() or the first save
        self._failed_periodic_saves = 0
        self._fence_reported = False
        self._owner_pid = os.getpid()
        self._checkpoint_requests = (control.CheckpointRequestWatcher(self._env.control_dir)
                                     if self._env.control_dir else None)
        self._events = TrainingEvents(self._storage, self._env, event_interval_s, interval_steps)
        self._meter = SaveMeter(self._env.control_dir, publishes=dist.local_rank() == 0,
                                check_interval_steps=check_interval_steps, on_save_ended=self._events.save_ended)
        self._retainer = Retainer(self._storage, RetentionPolicy.for_worker(
            keep_last, keep_every, self._env.keep_last, self._env.keep_every), timeout_s=save_timeout_s)
        self._background = BackgroundSaver(self._meter, after_commit=self._retain)
        self.preempted = False
        #: Bytes this rank read from storage in :meth:`restore` (format-4 steps; 0 before).
        self.restore_bytes_read = 0
        self._meshes_now: list[dict[str, Any]] = []  # of the state's DTensors, found by a restore
        self._requests = StopRequests(self._env, handle_signals=handle_signals)

    # --- properties -----------------------------------------------------------

    @property
    def storage(self) -> Storage:
        """The storage backend in use."""
        return self._storage

    @property
    def incarnation(self) -> int | None:
        """The incarnation this process claimed on the root (``None`` before
        :meth:`restore` or the first save); see :mod:`spotrun.checkpoint.fencing`."""
        return self._incarnation

    @property
    def last_saved_step(self) -> int | None:
        """The newest step this process saved (committed) or restored, if any; a background
        save counts once it committed."""
        current = self._background.in_flight
        if current is not None and current.committed:
            return max(current.step, self._last_saved_step or 0)
        return self._last_saved_step

    @property
    def save_in_flight(self) -> int | None:
        """The step of the background save in flight (written, or ended but not yet reported
        by :meth:`end_of_step`), else ``None``."""
        current = self._background.in_flight
        return None if current is None else current.step

    @property
    def step_time_s(self) -> float | None:
        """Seconds one training step takes (see :attr:`spotrun.train.meter.SaveMeter.step_time_s`)."""
        return self._meter.step_time_s

    # --- saving ---------------------------------------------------------------

    @reports_fence
    def end_of_step(self, step: int) -> bool:
        """Call once per training step, after the optimizer step, on every rank; True: stop
        the loop now (and exit 0; :attr:`preempted` is set).

        Every ``check_interval_steps`` steps one all-reduce agrees what the ranks were asked
        (a supervisor's request file, a signal, a supervisor that is gone:
        :mod:`spotrun.train.requests`; an ordinary checkpoint) and whether a background save
        is still being written anywhere; :func:`spotrun.train.decision.decide` then picks, the
        same on every rank: stop without saving (a supervisor found no time for a save; the
        newest complete checkpoint stays the resume point), the emergency checkpoint of this
        step (also when ``step`` reached ``$SPOTRUN_STOP_AT_STEP``), a requested or periodic
        checkpoint (training goes on), or nothing.
        With ``background_saves`` those saves return once the state is staged; a background
        save that failed is reported here (logged, or raised as below) at the first step
        that looks for requests after it ended on every rank, or at the next due save. A
        stop with a background save in flight finishes or abandons it as
        :mod:`spotrun.checkpoint.in_flight` decides, and logs which.

        Raises:
            CheckpointSaveError: the emergency save failed, or too many periodic saves
                failed in a row.
            FencedError: a newer start of the job claimed the checkpoint root (this process
                is an orphaned older incarnation): nothing was committed; stop.
        """
        self._meter.step_boundary()
        self._events.step_reached(step)
        self._background.publish_progress()
        context = StepContext(step, self.interval_steps, self._env.stop_at_step)
        asked, still_running = None, None  # None: not looked at this step
        if step % self.check_interval_steps == 0:
            asked = self._requests.read()
            checkpoint = self._checkpoint_requests is not None and self._checkpoint_requests.pending()
            # one more flag in the same all-reduce: is a background save still being written anywhere?
            save_and_stop, stop_without_save, checkpoint, still_running = dist.any_rank_each(
                [asked.save_and_stop, asked.stop_without_save, checkpoint, self._background.running])
            context = replace(context, save_and_stop=save_and_stop, stop_without_save=stop_without_save,
                              checkpoint_requested=checkpoint)
            if not still_running and self._background.in_flight is not None:  # ended on every rank:
                self._report_background(self._background.take())  # every rank reports it at this step
        decision = decide(context)
        if decision.action is Action.STOP_WITHOUT_SAVE:
            self._stop_without_save(step, asked)
        elif decision.action is Action.SAVE_AND_STOP:  # $SPOTRUN_STOP_AT_STEP needs no look: read once here
            self._emergency_save(step, asked or self._requests.read(), why=decision.why)
        elif decision.action is Action.SAVE:
            served = self._due_save(step, decision.reason, still_running)
            if served and decision.reason == "requested" and self._checkpoint_requests is not None:
                self._checkpoint_requests.handled()
        return decision.stops

    @reports_fence
    @gc_paused()
    def save(self, step: int, reason: str = "manual", *, timeout_s: float | None = None) -> None:
        """Save and commit ``step`` now, on every rank (a collective), from the live tensors.

        Waits first for a background save in flight (its failure counts as a failed
        periodic save). Does nothing if this step is already saved (e.g. a periodic save at
        the last step).

        Args:
            step: the training step being saved.
            reason: recorded in the manifest (``periodic``, ``emergency``, ``final``...).
            timeout_s: bound of this save's storage operations in seconds; default
                ``save_timeout_s``. A rank whose writes run past it fails the save, and
                with it every rank.

        Raises:
            StateSerializationError: a state value is neither a tensor nor JSON (names its key).
            CheckpointSaveError: the save failed; nothing was committed.
            FencedError: a newer incarnation started on the root; nothing was committed.
        """
        if self._background.in_flight is not None:
            self._report_background(self._background.take())
        if self._last_saved_step == step:
            return
        started_s = self._meter.save_started(step, reason)
        try:
            replicated, rank_local = self._state_dicts()
            with self._storage.deadline(self.save_timeout_s if timeout_s is None else timeout_s):
                context = self._context(step, reason, replicated, rank_local)
                saved = save_step(self._storage, step, replicated, rank_local, context, self._limits)
        except BaseException:
            self._meter.save_ended(step, reason, started_s, None)
            raise
        self._last_saved_step = step
        duration_s = self._meter.save_ended(step, reason, started_s, saved.size_bytes)
        if saved.manifest is not None:
            log.info("committed step %d (%s): %d files, %.1f MiB in %.2f s",
                     step, reason, len(saved.manifest.files), saved.size_bytes / 2**20, duration_s)
        self._retain(step, reason)

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the replicated state, this rank's own state) as state dicts of the live objects."""
        return ({name: state_of(obj) for name, obj in self._state.items()},
                {name: state_of(obj) for name, obj in self._rank_state.items()})

    def _retain(self, step: int, reason: str) -> None:  # on global rank 0; an emergency save's grace is the save's
        if dist.rank() == 0 and reason != "emergency":
            self._retainer.after_commit(step, self._incarnation)

    def _context(self, step: int, reason: str, replicated: dict[str, Any], rank_local: dict[str, Any]) -> SaveContext:
        """The save's context; a save without :meth:`restore` first claims this start's
        incarnation (collective), once the state can be saved. Call under a storage deadline."""
        if self._incarnation is None:
            encode_state(replicated, rank_local, dist.rank())  # raises before anything is claimed
            self._incarnation = claim_incarnation(
                self._storage, resumed_step=None, at_least=self._env.incarnation, run_id=self._run_id,
                after_newest=True, saving_step=step, worker_env=self._env)
            self._events.started(self._incarnation, None, 0)
        return SaveContext(reason=reason, run_id=self._run_id, incarnation=self._incarnation,
                           step_time_s=self._meter.step_time_s)

    def _report_fenced(self, exc: FencedError) -> None:
        """Under ``spotrun run``: tell the supervisor (once, from local rank 0) that a newer
        start fenced this launch, so that it stops instead of restarting it
        (:mod:`spotrun.train.fence_report`)."""
        if self._fence_reported or not self._env.control_dir or dist.local_rank() != 0:
            return
        self._fence_reported = True
        report_fenced(self._storage, self._env.control_dir, self._incarnation, exc)

    @reports_fence
    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) ended on this rank (call it
        on every rank at the same point, as :meth:`save`).

        Raises:
            CheckpointSaveError: it failed (the error it failed with; it is not counted as a
                failed periodic save then).
            FencedError: a newer incarnation started on the root; nothing was committed.
        """
        self._report_background(self._background.take(), count_failure=False)

    @reports_fence
    def close(self) -> None:
        """Wait for the background save in flight (its failure is reported as in
        :meth:`end_of_step`), stop the background thread and free its process group and
        staging buffers, then restore the signal handlers that were in place before this
        Checkpointer. Safe to call twice; a later save starts them again."""
        if os.getpid() != self._owner_pid:
            return
        try:
            self._report_background(self._background.take())
        finally:
            self._background.shutdown()
            self._requests.restore_signal_handlers()
            self._events.close()

