"""Restoring the training state at the start of a job: the newest loadable complete step, then
this start's incarnation.

A mixin of :class:`spotrun.train.checkpointer.Checkpointer` (uses its state, storage, environment,
meter and event log), kept apart from saving and stopping.
"""

from __future__ import annotations

import logging
import time

from spotrun.tools import dist
from spotrun.train.apply import apply_loaded, check_serialisable, restore_destinations
from spotrun.checkpoint.claim import claim_incarnation
from spotrun.checkpoint.restore import load_newest
from spotrun.train.fence_report import reports_fence
from spotrun.tools.gc_pause import gc_paused
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_layout import restored_onto

log = logging.getLogger("spotrun.checkpointer")


class RestoringMixin:
    """The Checkpointer's :meth:`restore`."""

    @reports_fence
    @gc_paused()
    def restore(self) -> int:
        """Load the newest loadable complete checkpoint into every object; return its step.

        Lists the checkpoints again and starts from the newest complete step (at least the
        step the supervisor chose, ``$SPOTRUN_RESUME_STEP``: a step committed since, by an
        orphaned older incarnation still saving, is newer and stays valid). Then claims this
        start's incarnation, recording the step it resumed from, which fences every later
        commit of an older incarnation (:mod:`spotrun.checkpoint.fencing`). If a step fails verification
        on any rank (checksum, missing file, bad manifest, files that disagree with the manifest or
        each other, an RNG state the generator rejects), every rank falls back to the
        next older complete step together, and the log says so.

        Returns:
            The restored step, or 0 when there is nothing to resume.

        Raises:
            StateMismatchError: the checkpoint does not fit these objects (a tensor of another global shape,
                a missing top-level name, keys a module or optimizer does not accept); another world
                size or layout is resharded, not refused.
            StateSerializationError: a state value could never be saved (checked here, before
                training starts, so the first save does not fail hours later).
            NoCheckpointError: complete steps exist but none of them loads.
        """
        started_s = time.monotonic()
        self._events.restore_started()
        step, manifest = self._restore()
        if manifest is not None:
            self._meter.restore_ended(step, time.monotonic() - started_s, self.restore_bytes_read)
        check_serialisable(self._state, self._rank_state)  # refused before this start leaves any trace on the root
        self._incarnation = claim_incarnation(
            self._storage, resumed_step=step if manifest else None, run_id=self._run_id,
            at_least=max(self._env.incarnation, manifest.incarnation + 1 if manifest else 0), worker_env=self._env)
        self._events.started(self._incarnation, step if manifest else None, self.restore_bytes_read)
        if dist.rank() == 0:
            log.info("%s (incarnation %d)", f"restored step {step} from {self._storage.uri}" if manifest
                     else f"no checkpoint under {self._storage.uri}: starting from step 0", self._incarnation)
        return step

    def _restore(self) -> tuple[int, Manifest | None]:
        """Load the newest loadable complete step: (its step and manifest), or (0, None)."""
        loaded = load_newest(self._storage, supervisor_step=self._env.resume_step, destinations=self._destinations,
                             apply=lambda step: apply_loaded(step, self._state, self._rank_state))
        if loaded is None:
            return 0, None
        self.restore_bytes_read = loaded.bytes_read
        step = loaded.manifest.step
        if dist.rank() == 0:
            log.info("%s", restored_onto(step, loaded.manifest.world_size, loaded.manifest.meshes, dist.world_size(),
                                         self._meshes_now))
        self._last_saved_step = step
        timing = loaded.manifest.timing
        self._meter.restored(timing.step_time_s if timing is not None else None)
        self._run_id = self._env.run_id or loaded.manifest.run_id or self._run_id
        return step, loaded.manifest

    def _destinations(self) -> dict:
        """The live tensors a restore reads into (:func:`~spotrun.train.apply.restore_destinations`)."""
        tensors, self._meshes_now = restore_destinations(self._state, self._rank_state)
        return tensors
