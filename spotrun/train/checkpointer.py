"""The training-loop API: periodic and emergency checkpoints, and exact resume (the loop: see the README).

:class:`Checkpointer` holds its settings (:class:`~spotrun.train.options.CheckpointerOptions`) and parts
that own their state: the saves (:class:`~spotrun.train.saving.Saves`), the run id and incarnation
(:class:`~spotrun.train.identity.Identity`), the restore (:func:`~spotrun.train.restoring.restore_state`)
and the stop path (:mod:`spotrun.train.stopping`); "when to save" is :func:`spotrun.train.decision.decide`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from functools import partial
from typing import Any

from spotrun.checkpoint.background import BackgroundSaver
from spotrun.checkpoint.save_bounds import before_deadline_s
from spotrun.checkpoint.shard import DEFAULT_MAX_FILE_SIZE_BYTES, DEFAULT_MAX_HEADER_BYTES
from spotrun.control import files as control
from spotrun.control import listeners
from spotrun.control.env import DEFAULT_CHECKPOINT_URI, DEFAULT_SAVE_TIMEOUT_S, WorkerEnv
from spotrun.errors import CollectiveTimeoutError, FencedError
from spotrun.state.ddp_buckets import DDP_BUCKETS_STATE_NAME, DDPBucketsState
from spotrun.state.numerics import NUMERICS_STATE_NAME, NumericsState, settle_vector_math
from spotrun.state.optimizer import pair_optimizers
from spotrun.state.rng import RNGState
from spotrun.storage import Storage, open_storage
from spotrun.tools import dist
from spotrun.tools.gc_pause import gc_paused
from spotrun.train.agreement import Agreement, Flags, pipelines
from spotrun.train.apply import check_state_names
from spotrun.train.decision import Action, StepContext, decide
from spotrun.train.events import TrainingEvents
from spotrun.train.fast_tier import MEMORY_TIER, open_fast_tier
from spotrun.train.fence_report import reports_fence
from spotrun.train.hang_report import report_collective_timeout, reports_collective_timeout
from spotrun.train.identity import Identity
from spotrun.train.meter import SaveMeter
from spotrun.train.options import ON_SAVE_IN_FLIGHT, CheckpointerOptions, option_attribute  # noqa: F401 (as before)
from spotrun.train.requests import Asked, StopRequests
from spotrun.train.restoring import Restored, restore_state
from spotrun.train.saving import Saves
from spotrun.train.stopping import report_stop, stop

log = logging.getLogger("spotrun.checkpointer")  # the Checkpointer's log lines, as they always were


class Checkpointer:
    """Saves and restores the whole training state of every rank.

    Args:
        state: name -> object to checkpoint. Objects with ``state_dict()`` / ``load_state_dict()`` (model,
            optimizer, LR scheduler, gradient scaler, :class:`spotrun.data.loader.ResumableDataLoader`) or plain
            dicts of tensors and JSON values. Plain tensors must be identical on every rank (DDP replicas): they
            are written once in total, spread over the ranks by bytes. DTensors (FSDP2, tensor parallel, HSDP)
            are written by the ranks that hold them, each chunk once, and load into any layout
            (:mod:`spotrun.checkpoint.sharded`). An optimizer whose parameters belong to a module in ``state``
            is saved keyed by parameter name (:mod:`spotrun.state.optimizer`).
        rank_state: name -> object whose state differs per rank (saved by each rank). Every rank's RNGs
            (Python, NumPy, torch CPU, each CUDA device) are always saved, and the settings that decide its
            arithmetic (intra-op threads, torch version, CPU capability, GPU models; :mod:`spotrun.state.numerics`):
            a restore logs a warning when they differ from the writer's; and the gradient bucket layout of DDP
            wrappers (:mod:`spotrun.state.ddp_buckets`). Names ``rng``, ``numerics`` and ``ddp_buckets`` are reserved.
        storage: a ready storage backend (overrides ``uri``; for tests and embedding).
        uri, interval_steps, ..., keep_every: the settings, one line each in
            :class:`~spotrun.train.options.CheckpointerOptions`; kept as :attr:`options`.

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
        memory_interval_steps: int | None = None,
        memory_dir: str | None = None,
        memory_budget_bytes: int | None = None,
        restore_timeout_s: float | None = None,
        agreement_timeout_s: float | None = None,
        agreement: str | None = None,
    ) -> None:
        check_state_names(state, rank_state)
        settle_vector_math()  # before the restore and the first step: a resumed run computes as the first one did
        arguments = (
            locals()
        )  # the settings are named as the options' fields (tests/unit/train/test_checkpointer_options.py)
        options = CheckpointerOptions(**{f.name: arguments[f.name] for f in fields(CheckpointerOptions)})
        # optimizers keyed by parameter name (DCP's state_dict helpers): any layout loads them
        self._state = pair_optimizers(dict(state))
        self._rank_state = {
            **(rank_state or {}),
            NUMERICS_STATE_NAME: NumericsState(),
            DDP_BUCKETS_STATE_NAME: DDPBucketsState(state),
            "rng": RNGState(),  # last: loaded after everything else, nothing draws after it
        }
        self._env = env = WorkerEnv.from_environ()
        self.options = options
        self._bounded = options = options.with_timeouts(env)  # the options with every bound a number
        # Under `spotrun run`: say that this worker reads the save request, so the supervisor
        # sends it no signal (spotrun.supervisor.foreign); first, before a long restore.
        listeners.announce("checkpointer")
        self._storage = storage or open_storage(options.uri or env.checkpoint_uri or DEFAULT_CHECKPOINT_URI)
        self._restored: Restored | None = None
        self._owner_pid = os.getpid()
        self._checkpoint_requests = control.CheckpointRequestWatcher(env.control_dir) if env.control_dir else None
        self._events = TrainingEvents(self._storage, env, event_interval_s, interval_steps)
        self._identity = Identity(self._storage, env, self._events)
        self._agreement = Agreement(pipelines(options.agreement, dist.world_size()))
        if self._agreement.pipelined and dist.rank() == 0:
            log.info(
                "the per-step agreement is pipelined (%d ranks): a request is acted on one look after it was seen",
                dist.world_size(),
            )
        self._meter = SaveMeter(
            env.control_dir,
            publishes=dist.local_rank() == 0,
            # the steps from a request to acting on it, as the supervisor's estimate counts them
            check_interval_steps=check_interval_steps * (2 if self._agreement.pipelined else 1),
            on_save_ended=self._events.save_ended,
        )
        self._saves = Saves(options, env, self._storage, self._meter, self._identity, self._state, self._rank_state)
        try:  # its nodes are gathered here: the first of spotrun's collectives
            self._tier = open_fast_tier(
                options,
                env,
                self._identity,
                self._state,
                self._rank_state,
                on_save_ended=partial(self._events.save_ended, tier=MEMORY_TIER),
            )
        except CollectiveTimeoutError as exc:
            report_collective_timeout(env.control_dir, exc)
            raise
        self.preempted = False
        self._requests = StopRequests(env, handle_signals=handle_signals)

    # the settings that were attributes of the Checkpointer stay so (setting one replaces the options)
    interval_steps = option_attribute("interval_steps")
    check_interval_steps = option_attribute("check_interval_steps")
    max_failed_periodic_saves = option_attribute("max_failed_periodic_saves")
    save_timeout_s = option_attribute("save_timeout_s")
    background_saves = option_attribute("background_saves")
    on_save_in_flight = option_attribute("on_save_in_flight")

    def _use(self, options: CheckpointerOptions) -> None:  # by option_attribute's setter
        self.options = options
        self._bounded = self._saves.options = options.with_timeouts(self._env)

    @property
    def storage(self) -> Storage:
        """The storage backend in use."""
        return self._storage

    @property
    def incarnation(self) -> int | None:
        """The incarnation this process claimed on the root (``None`` before :meth:`restore` or the first save);
        see :mod:`spotrun.checkpoint.fencing`."""
        return self._identity.incarnation

    @property
    def last_saved_step(self) -> int | None:
        """The newest step this process saved (committed) or restored, if any; a background save counts once it
        committed."""
        return self._saves.last_committed_step

    @property
    def save_in_flight(self) -> int | None:
        """The step of the background save in flight (written, or ended but not yet reported by
        :meth:`end_of_step`), else ``None``."""
        current = self._saves.saver.in_flight
        return None if current is None else current.step

    @property
    def step_time_s(self) -> float | None:
        """Seconds one training step takes (see :attr:`spotrun.train.meter.SaveMeter.step_time_s`)."""
        return self._meter.step_time_s

    @property
    def restore_bytes_read(self) -> int:
        """Bytes this rank read from storage in :meth:`restore` (format-4 steps; 0 before)."""
        return self._restored.bytes_read if self._restored is not None else 0

    @property
    def restore_bytes_received(self) -> int:
        """Bytes this rank received from the other ranks in :meth:`restore` instead of reading them
        from storage (boxes several ranks need are read once: :mod:`spotrun.checkpoint.cooperative`)."""
        return self._restored.bytes_received if self._restored is not None else 0

    @property
    def _background(self) -> BackgroundSaver:  # for tests that look at the staging buffers
        return self._saves.saver

    @reports_collective_timeout
    @reports_fence
    @gc_paused()
    def restore(self) -> int:
        """Load the newest loadable complete checkpoint into every object; return its step.

        Lists the checkpoints again and starts from the newest complete step (at least the step the supervisor
        chose, ``$SPOTRUN_RESUME_STEP``: a step committed since, by an orphaned older incarnation still saving, is
        newer and stays valid). Then claims this start's incarnation, recording the step it resumed from, which
        fences every later commit of an older incarnation (:mod:`spotrun.checkpoint.fencing`). If a step fails
        verification on any rank (checksum, missing file, bad manifest, files that disagree with the manifest or
        each other, an RNG state the generator rejects), every rank falls back to the next older complete step
        together, and the log says so.

        Returns:
            The restored step, or 0 when there is nothing to resume.

        Raises:
            StateMismatchError: the checkpoint does not fit these objects (a tensor of another global shape, a
                missing top-level name, keys a module or optimizer does not accept); another world size or layout
                is resharded, not refused.
            StateSerializationError: a state value could never be saved (checked here, before training starts,
                so the first save does not fail hours later).
            NoCheckpointError: complete steps exist but none of them loads.
        """
        restored = restore_state(
            self._storage,
            self._env,
            self._state,
            self._rank_state,
            self._identity.run_id,
            self._meter,
            self._events,
            fast_tier=self._tier.storage if self._tier is not None else None,
            timeout_s=self._bounded.restore_timeout_s,
        )
        self._restored = restored
        self._identity.claimed(restored.run_id, restored.incarnation)
        if restored.manifest is not None:
            self._saves.saved(restored.step)
            if self._tier is not None:
                self._tier.restored(restored.step)
        return restored.step

    @reports_collective_timeout
    @reports_fence
    def end_of_step(self, step: int) -> bool:
        """Call once per training step, after the optimizer step, on every rank; True: stop the loop now
        (and exit 0; :attr:`preempted` is set).

        Every ``check_interval_steps`` steps one all-reduce agrees what the ranks were asked (a supervisor's
        request file, a signal, a supervisor that is gone: :mod:`spotrun.train.requests`; an ordinary
        checkpoint) and whether a background save is still being written anywhere;
        :func:`spotrun.train.decision.decide` then picks, the same on every rank: stop without saving (a
        supervisor found no time for a save; the newest complete checkpoint stays the resume point), the
        emergency checkpoint of this step (also when ``step`` reached ``$SPOTRUN_STOP_AT_STEP``), a requested or
        periodic checkpoint (training goes on), or nothing.
        With ``background_saves`` those saves return once the state is staged; a background save that failed
        is reported here (logged, or raised as below) at the first step that looks for requests after it ended
        on every rank, or at the next due save. A stop with a background save in flight finishes or abandons
        it as :mod:`spotrun.checkpoint.in_flight` decides, and logs which.

        Raises:
            CheckpointSaveError: the emergency save failed, or too many periodic saves failed in a row.
            FencedError: a newer start of the job claimed the checkpoint root (this process is an orphaned
                older incarnation): nothing was committed; stop.
        """
        self._meter.step_boundary()
        self._events.step_reached(step)
        self._saves.saver.publish_progress()
        context = StepContext(step, self.interval_steps, self._env.stop_at_step)
        asked, still_running, tier_running = None, None, None  # None: not known at this step
        looks = step % self.check_interval_steps == 0
        if looks:
            asked = self._requests.read()
            agreed = self._agreement.look(
                partial(self._flags, asked),
                self._saves.saver.in_flight,
                self._tier_in_flight(),
                timeout_s=self._agreement_timeout_s(asked),
                what=f"the per-step agreement at step {step}",
            )
            if agreed is not None:
                context = replace(
                    context,
                    save_and_stop=agreed.save_and_stop,
                    stop_without_save=agreed.stop_without_save,
                    save_to_memory=agreed.save_to_memory,
                    checkpoint_requested=agreed.checkpoint_requested,
                )
                still_running, tier_running = agreed.save_running, agreed.tier_running
            if still_running is False and self._saves.saver.in_flight is not None:  # ended on every rank:
                self._saves.report(self._saves.saver.take())  # every rank reports it at this step
            if self._tier is not None and tier_running is False:
                self._tier.report_ended()
        decision = decide(context)
        if decision.stops:
            if self._tier is not None:  # the emergency save comes first; a fast-tier write is abandoned
                self._tier.abandon()
            saved = stop(decision, self._saves, self._requests, step, asked, self._tier)
            self.preempted = True
            to_memory = decision.action is Action.SAVE_TO_MEMORY_AND_STOP
            report_stop(self._events, self._env.control_dir, step, saved=saved, tier="memory" if to_memory else None)
            if saved and self._tier is not None and not to_memory:  # after storage, which the supervisor was told of
                left_s = self._requests.emergency_timeout_s(
                    asked or self._requests.read(), self._saves.options.save_timeout_s
                )
                self._tier.save_stopping(step, left_s)
        elif decision.action is Action.SAVE:
            served = self._saves.due(step, decision.reason, still_running)
            if served and decision.reason == "requested" and self._checkpoint_requests is not None:
                self._checkpoint_requests.handled()
        if not decision.stops and self._tier is not None and self._tier.due(step):
            self._tier.save(step, tier_running)
        if decision.stops:
            self._agreement.drop()
        elif looks and self._agreement.pipelined:  # the next look reads it, this step's saves included
            self._agreement.start_next(
                self._flags(asked),
                timeout_s=self._agreement_timeout_s(asked),
                what=f"the agreement started at step {step}",
            )
        return decision.stops

    def _flags(self, asked: Asked) -> Flags:
        """This rank's flags for the agreement (one more: is a background save still being written?)."""
        return Flags(
            save_and_stop=asked.save_and_stop,
            stop_without_save=asked.stop_without_save,
            save_to_memory=asked.save_to_memory,
            checkpoint_requested=self._checkpoint_requests is not None and self._checkpoint_requests.pending(),
            save_running=self._saves.saver.running,
            tier_running=self._tier is not None and self._tier.running,
            save_in_flight=self._saves.saver.in_flight,
            tier_in_flight=self._tier_in_flight(),
        )

    def _tier_in_flight(self) -> object:
        return self._tier.saves.saver.in_flight if self._tier is not None and self._tier.enabled else None

    def _agreement_timeout_s(self, asked: Asked) -> float:
        """The agreement's bound: ``agreement_timeout_s``; when this rank was asked to stop, short enough
        to name a rank that did not arrive before the stop's deadline (:func:`before_deadline_s`)."""
        bound_s = self._bounded.agreement_timeout_s
        if asked.save_and_stop or asked.stop_without_save:
            bound_s = before_deadline_s(self._requests.emergency_timeout_s(asked, bound_s))
        return bound_s

    @reports_collective_timeout
    @reports_fence
    def save(self, step: int, reason: str = "manual", *, timeout_s: float | None = None) -> None:
        """Save and commit ``step`` now, on every rank (a collective), from the live tensors.

        Waits first for a background save in flight (its failure counts as a failed periodic save). Does
        nothing if this step is already saved (e.g. a periodic save at the last step).

        Args:
            step: the training step being saved.
            reason: recorded in the manifest (``periodic``, ``emergency``, ``final``...).
            timeout_s: bound of this save's storage operations in seconds; default ``save_timeout_s``. A rank
                whose writes run past it fails the save, and with it every rank.

        Raises:
            StateSerializationError: a state value is neither a tensor nor JSON (names its key).
            CheckpointSaveError: the save failed; nothing was committed.
            FencedError: a newer incarnation started on the root; nothing was committed.
        """
        self._saves.save_now(step, reason, timeout_s)

    def _report_fenced(self, exc: FencedError) -> None:  # by @reports_fence
        self._identity.report_fenced(exc)

    @reports_collective_timeout
    @reports_fence
    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) ended on this rank (call it on every rank at the
        same point, as :meth:`save`).

        Raises:
            CheckpointSaveError: it failed (the error it failed with; not counted as a failed periodic save then).
            FencedError: a newer incarnation started on the root; nothing was committed.
        """
        self._saves.report(self._saves.saver.take(), count_failure=False)

    @reports_collective_timeout
    @reports_fence
    def close(self) -> None:
        """Wait for the background save in flight (its failure is reported as in :meth:`end_of_step`), stop the
        background thread and free its process group and staging buffers, then restore the signal handlers that
        were in place before this Checkpointer. Safe to call twice; a later save starts them again."""
        if os.getpid() != self._owner_pid:
            return
        try:
            self._agreement.drop()  # a pipelined all-reduce started at the last step
            self._saves.report(self._saves.saver.take())
        finally:
            if self._tier is not None:
                self._tier.close()
            self._saves.saver.shutdown()
            self._requests.restore_signal_handlers()
            self._events.close()
