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

"When to save" (:meth:`Checkpointer.end_of_step`) is kept apart from "how to save"
(:mod:`spotrun.checkpoint.save`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

from spotrun import control, dist, supervisor_watch
from spotrun.checkpoint import resume
from spotrun.checkpoint.restore import LoadedStep
from spotrun.checkpoint.save import SaveContext, encode_state, save_step
from spotrun.checkpoint.shard import DEFAULT_MAX_FILE_SIZE_BYTES, DEFAULT_MAX_HEADER_BYTES, ShardLimits
from spotrun.manifest import Manifest
from spotrun.env import DEFAULT_CHECKPOINT_URI, WorkerEnv, default_safety_margin_s
from spotrun.save_meter import SaveMeter
from spotrun.errors import CheckpointSaveError, ConfigError, SpotrunError, StateMismatchError
from spotrun.state.numerics import NUMERICS_STATE_NAME, NumericsState
from spotrun.state.rng import RNGState
from spotrun.state.stateful import load_into, state_of
from spotrun.storage import Storage, open_storage

log = logging.getLogger(__name__)

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Default bound of one save's storage operations, in seconds.
DEFAULT_SAVE_TIMEOUT_S = 300.0


class Checkpointer:
    """Saves and restores the whole training state of every rank.

    Args:
        state: name -> object to checkpoint. Objects with ``state_dict()`` /
            ``load_state_dict()`` (model, optimizer, LR scheduler, gradient scaler,
            :class:`spotrun.data.ResumableDataLoader`) or plain dicts of tensors and
            JSON values. This state must be identical on every rank (DDP replicas): it
            is written once in total, spread over the ranks by bytes.
        uri: checkpoint root; default ``$SPOTRUN_CHECKPOINT_URI``, else ``./checkpoints``.
        interval_steps: save every this many steps in :meth:`end_of_step`; 0 = never.
        rank_state: name -> object whose state differs per rank (saved by each rank).
            Every rank's RNGs (Python, NumPy, torch CPU, each CUDA device) are always saved,
            and the settings that decide its arithmetic (intra-op threads, torch version, CPU
            capability, GPU models; :mod:`spotrun.state.numerics`): a restore logs a warning
            when they differ from the writer's. Names ``rng`` and ``numerics`` are reserved.
        check_interval_steps: look for a save request every this many steps (1 = every
            step; each check is one 1-element all-reduce).
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
            its own). One file's bytes are held in memory while it is written.
        max_header_bytes: most bytes of one shard file's safetensors header (default
            16 MiB; at most safetensors' limit of 100 MB, about a million small tensors);
            a rank with more tensors writes several files.

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
        self._limits = ShardLimits(max_file_size_bytes=max_file_size_bytes, max_header_bytes=max_header_bytes)
        self._state = dict(state)
        self._rank_state = {**(rank_state or {}), NUMERICS_STATE_NAME: NumericsState(), "rng": RNGState()}
        self._env = WorkerEnv.from_environ()
        self._storage = storage or open_storage(uri or self._env.checkpoint_uri or DEFAULT_CHECKPOINT_URI)
        self.interval_steps = interval_steps
        self.check_interval_steps = check_interval_steps
        self.max_failed_periodic_saves = max_failed_periodic_saves
        self.save_timeout_s = save_timeout_s
        self._run_id = self._env.run_id or uuid.uuid4().hex
        self._last_saved_step: int | None = None
        self._incarnation: int | None = None  # claimed by restore() or the first save
        self._failed_periodic_saves = 0
        self._signal_name: str | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._owner_pid = os.getpid()
        self._checkpoint_requests = (
            control.CheckpointRequestWatcher(self._env.control_dir) if self._env.control_dir else None
        )
        self._meter = SaveMeter(self._env.control_dir, publishes=dist.local_rank() == 0,
                                check_interval_steps=check_interval_steps)
        self.preempted = False
        # Under `spotrun run`: a supervisor that dies (even by SIGKILL) is a stop request, and
        # this process ends itself a grace period later at the latest (spotrun.supervisor_watch).
        self._supervisor = supervisor_watch.watch(self._env)
        if handle_signals:
            self._install_signal_handlers()

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
        """The newest step this process saved or restored, if any."""
        return self._last_saved_step

    # --- restore --------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest loadable complete checkpoint into every object; return its step.

        Lists the checkpoints again and starts from the newest complete step (at least the
        step the supervisor chose, ``$SPOTRUN_RESUME_STEP``: a step committed since, by an
        orphaned older incarnation still saving, is newer and stays valid). Then claims this
        start's incarnation, recording the step it resumed from, which fences every later
        commit of an older incarnation (:mod:`spotrun.checkpoint.fencing`). If a step fails verification
        on any rank (checksum, missing file, bad manifest), every rank falls back to the
        next older complete step together, and the log says so.

        Returns:
            The restored step, or 0 when there is nothing to resume.

        Raises:
            StateMismatchError: the checkpoint does not fit these objects (other world size,
                a missing top-level name, keys a module or optimizer does not accept).
            StateSerializationError: a state value could never be saved (checked here, before
                training starts, so the first save does not fail hours later).
            NoCheckpointError: complete steps exist but none of them loads.
        """
        step, manifest = self._restore()
        self._check_serialisable()  # refused before this start leaves any trace on the root
        self._incarnation = resume.claim_incarnation(
            self._storage, resumed_step=step if manifest else None, run_id=self._run_id,
            at_least=max(self._env.incarnation, manifest.incarnation + 1 if manifest else 0))
        if dist.rank() == 0:
            log.info("%s (incarnation %d)", f"restored step {step} from {self._storage.uri}" if manifest
                     else f"no checkpoint under {self._storage.uri}: starting from step 0", self._incarnation)
        return step

    def _check_serialisable(self) -> None:
        """Fail before training starts, not at the first save hours later."""
        encode_state(
            {name: state_of(obj) for name, obj in self._state.items()},
            {name: state_of(obj) for name, obj in self._rank_state.items()},
            dist.rank(),
        )

    def _restore(self) -> tuple[int, Manifest | None]:
        """Load the newest loadable complete step: (its step and manifest), or (0, None)."""
        loaded = resume.load_newest(self._storage, supervisor_step=self._env.resume_step,
                                    destinations=self._restore_destinations())
        if loaded is None:
            return 0, None
        self._apply(loaded)
        step = loaded.manifest.step
        self._last_saved_step = step
        timing = loaded.manifest.timing
        self._meter.restored(timing.step_time_s if timing is not None else None)
        self._run_id = self._env.run_id or loaded.manifest.run_id or self._run_id
        return step, loaded.manifest

    def _restore_destinations(self) -> dict:
        """The live tensors by encoded name, for a restore to read straight into (no copy
        through fresh memory); empty when the state cannot be encoded (reported later)."""
        try:
            encoded = encode_state({name: state_of(obj) for name, obj in self._state.items()},
                                   {name: state_of(obj) for name, obj in self._rank_state.items()}, dist.rank())
        except SpotrunError:
            return {}
        return {**encoded.tensors, **encoded.rank_tensors}

    def _apply(self, loaded: LoadedStep) -> None:
        extra = sorted(set(loaded.replicated) - set(self._state))
        if extra and dist.rank() == 0:
            log.warning("checkpoint step %d also holds state %s, which this job does not restore",
                        loaded.manifest.step, extra)
        for name, obj in self._state.items():
            if name not in loaded.replicated:
                raise StateMismatchError(
                    f"checkpoint step {loaded.manifest.step} has no state named {name!r} "
                    f"(it has {sorted(loaded.replicated)})"
                )
            load_into(name, obj, loaded.replicated[name])
        for name, obj in self._rank_state.items():  # RNG last: nothing may draw after it
            if name == NUMERICS_STATE_NAME and name not in loaded.rank_local:
                continue  # written before spotrun recorded these settings
            if name not in loaded.rank_local:
                raise StateMismatchError(f"checkpoint lacks this rank's state {name!r}")
            load_into(name, obj, loaded.rank_local[name])

    # --- saving ---------------------------------------------------------------

    def end_of_step(self, step: int) -> bool:
        """Call once per training step, after the optimizer step, on every rank.

        Agrees across ranks whether a save was requested (a supervisor's request file, a
        signal, or a supervisor that is gone - see :mod:`spotrun.supervisor_watch` - on any
        rank); if so, every rank saves this same step as an emergency
        checkpoint, and this returns True: the loop must stop and the process exit 0.
        When a supervisor asked to stop *without* saving (it estimated that a save cannot
        commit before the deadline), every rank stops at this step without saving and this
        returns True as well (:attr:`preempted` is set either way); the newest complete
        checkpoint stays the resume point.
        When ``$SPOTRUN_STOP_AT_STEP`` is set and ``step`` is at or past it, every rank
        behaves as on an agreed save request: it takes the emergency checkpoint of this
        step (under a supervisor, which then exits 143) and this returns True; every rank
        reads the same variable at the same step, so this needs no collective.
        Otherwise saves a periodic checkpoint every ``interval_steps``, and an ordinary
        checkpoint when the supervisor asked for one (e.g. on an AWS rebalance
        recommendation) - training then goes on. One all-reduce decides both.

        Raises:
            CheckpointSaveError: the emergency save failed, or too many periodic saves
                failed in a row.
            FencedError: a newer start of the job claimed the checkpoint root (this process
                is an orphaned older incarnation): nothing was committed; stop.
        """
        self._meter.step_boundary()
        checkpoint_requested = False
        if step % self.check_interval_steps == 0:
            save_requested, stop_requested = self._stop_requests()
            stop, no_save, checkpoint_requested = dist.any_rank_each(
                [save_requested, stop_requested,
                 self._checkpoint_requests is not None and self._checkpoint_requests.pending()]
            )
            if no_save:  # one node's supervisor found no time to save: nobody saves
                self._stop_without_save(step)
                return True
            if stop:
                self._emergency_save(step)
                return True
        if self._stop_step_reached(step):  # $SPOTRUN_STOP_AT_STEP: the same on every rank
            self._emergency_save(step, why=f"SPOTRUN_STOP_AT_STEP={self._env.stop_at_step}")
            return True
        if checkpoint_requested:
            if self._checkpoint_requests is not None:
                self._checkpoint_requests.handled()
            self._periodic_save(step, reason="requested")
        elif self.interval_steps and step % self.interval_steps == 0:
            self._periodic_save(step)
        return False

    def _stop_step_reached(self, step: int) -> bool:
        """Whether ``$SPOTRUN_STOP_AT_STEP`` asks to stop at ``step`` (``step >=`` it).

        Every rank reads the same variable and is at the same step, so the ranks agree
        without a collective.
        """
        return self._env.stop_at_step is not None and step >= self._env.stop_at_step

    def save(self, step: int, reason: str = "manual", *, timeout_s: float | None = None) -> None:
        """Save and commit ``step`` now, on every rank (a collective).

        Does nothing if this step is already saved (e.g. a periodic save at the last step).

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
        if self._last_saved_step == step:
            return
        started_s = self._meter.save_started(step, reason)
        try:
            replicated = {name: state_of(obj) for name, obj in self._state.items()}
            rank_local = {name: state_of(obj) for name, obj in self._rank_state.items()}
            with self._storage.deadline(self.save_timeout_s if timeout_s is None else timeout_s):
                if self._incarnation is None:  # saving without restore(): this start claims now,
                    encode_state(replicated, rank_local, dist.rank())  # once the state can be saved
                    self._incarnation = resume.claim_incarnation(
                        self._storage, resumed_step=None, at_least=self._env.incarnation, run_id=self._run_id,
                        after_newest=True, saving_step=step)
                context = SaveContext(reason=reason, run_id=self._run_id, incarnation=self._incarnation,
                                      step_time_s=self._meter.step_time_s)
                saved = save_step(self._storage, step, replicated, rank_local, context, self._limits)
        except BaseException:
            self._meter.save_ended(step, reason, started_s, None)
            raise
        self._last_saved_step = step
        duration_s = self._meter.save_ended(step, reason, started_s, saved.size_bytes)
        if saved.manifest is not None:
            log.info(
                "committed step %d (%s): %d files, %.1f MiB in %.2f s",
                step, reason, len(saved.manifest.files), saved.size_bytes / 2**20, duration_s,
            )

    def _periodic_save(self, step: int, reason: str = "periodic") -> None:
        try:
            self.save(step, reason=reason)
            self._failed_periodic_saves = 0
        except CheckpointSaveError as exc:
            if not exc.retryable:  # a newer start owns the root, or the store cannot commit
                raise
            self._failed_periodic_saves += 1
            log.error("periodic save of step %d failed (%d in a row): %s",
                      step, self._failed_periodic_saves, exc)
            if self._failed_periodic_saves > self.max_failed_periodic_saves:
                raise

    def _emergency_save(self, step: int, why: str | None = None) -> None:
        if dist.rank() == 0:
            log.warning("save requested (%s): emergency checkpoint of step %d",
                        why or self._describe_request(), step)
        # A dying DataLoader worker sends SIGCHLD, whose torch handler raises in this
        # thread; keep it from aborting the save. The process exits right after.
        previous_mask = None
        if threading.current_thread() is threading.main_thread():
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            if self._last_saved_step != step:
                self.save(step, reason="emergency", timeout_s=self._emergency_timeout_s())
        except BaseException:
            if previous_mask is not None:  # the process goes on (or unwinds): give SIGCHLD back
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            raise
        self.preempted = True
        if self._env.control_dir and dist.local_rank() == 0:
            control.write_commit_report(self._env.control_dir, step)

    def _emergency_timeout_s(self) -> float:
        """``save_timeout_s``, or less when the supervisor's request names an earlier deadline,
        or when the supervisor is gone (the save must end a safety margin before this process
        is killed)."""
        timeout_s = self.save_timeout_s
        request = control.read_save_request(self._env.control_dir) if self._env.control_dir else None
        if request is not None and request.deadline_unix_s is not None:
            timeout_s = min(timeout_s, request.deadline_unix_s - time.time())
        end_unix_s = self._supervisor.end_unix_s if self._supervisor is not None else None
        if end_unix_s is not None:
            margin_s = default_safety_margin_s(self._supervisor.grace_period_s)
            timeout_s = min(timeout_s, end_unix_s - margin_s - time.time())
        return timeout_s

    def _stop_requests(self) -> tuple[bool, bool]:
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
        return self._signal_name is not None or supervisor_gone, False

    def _stop_without_save(self, step: int) -> None:
        if dist.rank() == 0:
            log.warning(
                "stop requested without a save (%s): stopping after step %d; the newest complete "
                "checkpoint (step %s here) stays the resume point",
                self._describe_request(), step, self._last_saved_step,
            )
        self.preempted = True
        if self._env.control_dir and dist.local_rank() == 0:
            control.write_stop_report(self._env.control_dir, step)

    @property
    def step_time_s(self) -> float | None:
        """Seconds one training step takes (see :attr:`spotrun.save_meter.SaveMeter.step_time_s`)."""
        return self._meter.step_time_s

    def _describe_request(self) -> str:
        if self._signal_name:
            return self._signal_name
        if self._env.control_dir:
            request = control.read_save_request(self._env.control_dir)
            if request is not None:
                return f"supervisor: {request.reason}"
        if self._supervisor is not None and self._supervisor.gone:
            return f"the supervisor (pid {self._supervisor.supervisor_pid}) is gone"
        return "another rank"

    # --- signals --------------------------------------------------------------

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
        if signum == signal.SIGINT and self._signal_name == "SIGINT":
            raise KeyboardInterrupt
        self._signal_name = name

    def close(self) -> None:
        """Restore the signal handlers that were in place before this Checkpointer."""
        if os.getpid() != self._owner_pid:
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

