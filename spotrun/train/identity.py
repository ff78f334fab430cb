"""Who this process is on the checkpoint root: its run id and the incarnation it claimed (at a
restore, or at its first save without one), and the report to the supervisor when a newer start
fenced it (:mod:`spotrun.train.fence_report`).
"""

from __future__ import annotations

import uuid
from typing import Any

from spotrun.checkpoint.claim import claim_incarnation
from spotrun.checkpoint.encode import encode_state
from spotrun.checkpoint.save import SaveContext
from spotrun.checkpoint.save_bounds import collectives_deadline_s, phase_timeout_s
from spotrun.control.env import DEFAULT_SAVE_TIMEOUT_S, WorkerEnv
from spotrun.errors import FencedError
from spotrun.storage import Storage
from spotrun.tools import dist
from spotrun.train.events import TrainingEvents
from spotrun.train.fence_report import report_fenced


class Identity:
    """The run id and incarnation of one Checkpointer's process."""

    def __init__(self, storage: Storage, env: WorkerEnv, events: TrainingEvents) -> None:
        self._storage = storage
        self._env = env
        self._events = events
        self.run_id = env.run_id or uuid.uuid4().hex
        self.incarnation: int | None = None  # claimed by a restore or the first save
        self._fence_reported = False

    def claimed(self, run_id: str, incarnation: int) -> None:
        """A restore claimed ``incarnation`` and settled the run id."""
        self.run_id, self.incarnation = run_id, incarnation

    def save_context(
        self,
        step: int,
        reason: str,
        replicated: dict[str, Any],
        rank_local: dict[str, Any],
        step_time_s: float | None,
        until_s: float | None = None,
    ) -> SaveContext:
        """The save's context; a save without a restore first claims this start's incarnation
        (collective, giving up at ``until_s``: the save's collective deadline, by default that
        of a save bounded by the default save timeout), once the state can be saved. Call under
        a storage deadline."""
        if self.incarnation is None:
            until_s = until_s or collectives_deadline_s(DEFAULT_SAVE_TIMEOUT_S)
            encode_state(replicated, rank_local, dist.rank())  # raises before anything is claimed
            self.incarnation = claim_incarnation(
                self._storage,
                resumed_step=None,
                at_least=self._env.incarnation,
                run_id=self.run_id,
                after_newest=True,
                saving_step=step,
                worker_env=self._env,
                timeout_s=phase_timeout_s(until_s),
            )
            self._events.started(self.incarnation, None, 0)
        return SaveContext(reason=reason, run_id=self.run_id, incarnation=self.incarnation, step_time_s=step_time_s)

    def report_fenced(self, exc: FencedError) -> None:
        """Under ``spotrun run``: tell the supervisor (once, from local rank 0) that a newer
        start fenced this launch, so that it stops instead of restarting it."""
        if self._fence_reported or not self._env.control_dir or dist.local_rank() != 0:
            return
        self._fence_reported = True
        report_fenced(self._storage, self._env.control_dir, self.incarnation, exc)
