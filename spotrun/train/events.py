"""Rank 0's part of the event log (:mod:`spotrun.eventlog.records`), fed by the
:class:`~spotrun.train.checkpointer.Checkpointer`: ``start``, ``save``, ``stop``, ``exit`` and
``progress`` records in ``events/incarnation-<N>.rank-00000.jsonl``.

Nothing here may stall or fail training: records are written from the event log's own thread,
and every failure is logged, never raised. The records' fields:
``docs/design/internals.md`` (Event log and goodput).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from spotrun.control.env import WorkerEnv
from spotrun.eventlog.records import EventLog, progress_interval_s, rank_key
from spotrun.storage.base import Storage
from spotrun.tools import dist

log = logging.getLogger(__name__)


class TrainingEvents:
    """Rank 0's event records; on every other rank each method does nothing.

    Args:
        storage: the checkpoint root.
        env: the worker's environment (the supervisor's incarnation and pid).
        interval_s: least seconds between two writes of the progress record alone; ``None``:
            ``$SPOTRUN_EVENT_INTERVAL_S``, else 30.
        interval_steps: the Checkpointer's periodic save interval in steps (recorded).

    Raises:
        ConfigError: a bad interval.
    """

    def __init__(self, storage: Storage, env: WorkerEnv, interval_s: float | None, interval_steps: int) -> None:
        self._storage = storage
        self._env = env
        self._interval_s = progress_interval_s(interval_s)
        self._interval_steps = interval_steps
        self._log: EventLog | None = None
        self._restore_started_s: float | None = None

    def restore_started(self) -> None:
        """``restore()`` begins (its duration is recorded with the start)."""
        self._restore_started_s = time.monotonic()

    def started(
        self, incarnation: int, resumed_step: int | None, restore_bytes_read: int, restore_tier: str | None = None
    ) -> None:
        """This start claimed ``incarnation`` (after a restore from ``resumed_step``, None:
        nothing restored, read from ``restore_tier``): open its object and record the start."""
        restore_s = 0.0 if self._restore_started_s is None else time.monotonic() - self._restore_started_s
        self._restore_started_s = None
        if dist.rank() != 0:  # asked here, not earlier: the process group exists once restore() ran
            return
        self.close()  # a second restore() claims another incarnation
        self._log = EventLog(self._storage, rank_key(incarnation, 0), progress_interval_s=self._interval_s)
        self._append(
            "start",
            incarnation=incarnation,
            resumed_step=resumed_step,
            restore_s=round(restore_s, 6),
            restore_bytes_read=restore_bytes_read,
            restore_tier=restore_tier,
            world_size=dist.world_size(),
            interval_steps=self._interval_steps,
            event_interval_s=self._interval_s,
            launch_incarnation=self._env.incarnation if self._env.control_dir else None,
            supervisor_pid=self._env.supervisor_pid,
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    def step_reached(self, step: int) -> None:
        """``step`` ended (called from every ``end_of_step``: an assignment)."""
        if self._log is not None:
            self._log.progress(step)

    def save_ended(
        self,
        *,
        step: int,
        reason: str,
        committed: bool,
        background: bool,
        stall_s: float,
        duration_s: float,
        size_bytes: int | None,
        tier: str = "storage",
    ) -> None:
        """A save ended (any thread); ``tier``: where it was written, ``"storage"`` or ``"memory"``
        (the fast tier)."""
        self._append(
            "save",
            tier=tier,
            step=step,
            reason=reason,
            committed=committed,
            background=background,
            stall_s=round(stall_s, 6),
            duration_s=round(duration_s, 6),
            size_bytes=size_bytes,
        )

    def stopped(self, step: int, *, saved: bool) -> None:
        """The job stops after ``step``, which was saved or not."""
        self._append("stop", step=step, saved=saved)

    def close(self) -> None:
        """Record the exit (the last step reached) and write everything (bounded wait)."""
        if self._log is None:
            return
        last = self._log.last_progress
        self._append("exit", step=last[0] if last else None)
        try:
            self._log.close()
        except Exception as exc:  # noqa: BLE001 - never fail the job's exit
            log.warning("closing the event log failed: %s", exc)
        self._log = None

    def _append(self, event: str, **fields: Any) -> None:
        if self._log is None:
            return
        try:
            self._log.append(event, **fields)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be made must not stop training
            log.warning("event %r not recorded: %s", event, exc)
