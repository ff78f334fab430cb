"""Measuring training steps and saves for the supervisor's emergency-save estimate.

A :class:`SaveMeter` lives in each rank's :class:`~spotrun.checkpointer.Checkpointer`. It times
the training steps (the time spent in saves excluded) and every save, and local rank 0 of
each node publishes the figures to the node's supervisor as ``saves.json`` in the control
directory (:mod:`spotrun.control`); the supervisor estimates from them
(:mod:`spotrun.supervisor.estimate`).
"""

from __future__ import annotations

import collections
import logging
import time

from spotrun import control

log = logging.getLogger(__name__)

#: How many recent step durations the step-time estimate looks at.
STEP_TIMES_KEPT = 16


class SaveMeter:
    """Step and save timings of one rank.

    Args:
        control_dir: the node's control directory; ``None`` when no supervisor runs
            (nothing is published then).
        publishes: whether this rank publishes (local rank 0 of its node).
        check_interval_steps: steps between two looks at a save request (reported as is).
    """

    def __init__(self, control_dir: str | None, *, publishes: bool, check_interval_steps: int) -> None:
        self._control_dir = control_dir if publishes else None
        self._check_interval_steps = check_interval_steps
        self._step_times_s: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._last_boundary_s: float | None = None
        self._recorded_step_time_s: float | None = None
        self._recent: list[control.SaveRecord] = []

    @property
    def step_time_s(self) -> float | None:
        """Seconds one training step takes: the slowest of the last 16 steps (time in saves
        excluded); before two step boundaries were seen, the step time recorded in the
        restored checkpoint (:meth:`restored`), else ``None``."""
        return max(self._step_times_s) if self._step_times_s else self._recorded_step_time_s

    def restored(self, recorded_step_time_s: float | None) -> None:
        """Take the step time recorded in the checkpoint just restored, in seconds."""
        self._recorded_step_time_s = recorded_step_time_s

    def step_boundary(self) -> None:
        """Call at each step boundary: the time since the previous one is a step's duration."""
        now_s = time.monotonic()
        if self._last_boundary_s is not None:
            self._step_times_s.append(now_s - self._last_boundary_s)
        self._last_boundary_s = now_s

    def save_started(self, step: int, reason: str) -> float:
        """Publish that the save of ``step`` started; returns its start (``time.monotonic()``)."""
        self._publish(control.SaveInProgress(step=step, reason=reason, started_unix_s=time.time()))
        return time.monotonic()

    def save_ended(self, step: int, reason: str, started_s: float, size_bytes: int | None) -> float:
        """Record the end of a save and publish it; returns its duration in seconds.

        Args:
            step: the saved step.
            reason: why it was saved.
            started_s: what :meth:`save_started` returned.
            size_bytes: bytes of all the step's shard files; ``None`` when the save failed
                (nothing is recorded then, only that no save is in progress).
        """
        now_s = time.monotonic()
        if self._last_boundary_s is not None:
            self._last_boundary_s = now_s  # time in the save is not step time
        duration_s = now_s - started_s
        if size_bytes is not None:
            self._recent = [*self._recent, control.SaveRecord(
                step=step, reason=reason, size_bytes=size_bytes, duration_s=round(duration_s, 6),
                committed_unix_s=time.time(),
            )][-control.RECENT_SAVES:]
        self._publish(None)
        return duration_s

    def _publish(self, in_progress: control.SaveInProgress | None) -> None:
        if self._control_dir is None:
            return
        try:
            control.write_save_stats(self._control_dir, control.SaveStats(
                in_progress=in_progress, recent=tuple(self._recent), step_time_s=self.step_time_s,
                check_interval_steps=self._check_interval_steps,
            ))
        except OSError as exc:  # the supervisor then estimates from less; training goes on
            log.warning("cannot write the save measurements for the supervisor: %s", exc)
