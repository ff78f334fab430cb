"""Measuring training steps and saves for the supervisor's emergency-save estimate.

A :class:`SaveMeter` lives in each rank's :class:`~spotrun.train.checkpointer.Checkpointer`. It times
the training steps (the time spent blocked by saves excluded) and every save - for a
background save both the time training was blocked (the *stall*) and the whole save, start
to commit - and local rank 0 of each node publishes the figures to the node's supervisor as
``saves.json`` in the control directory (:mod:`spotrun.control.files`), with the progress of a
background save in flight; the supervisor estimates from them
(:mod:`spotrun.supervisor.estimate`). A background save ends on its worker thread, so the
meter is thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from spotrun.control import files as control

log = logging.getLogger(__name__)

#: How many recent step durations the step-time estimate looks at.
STEP_TIMES_KEPT = 16
#: Least seconds between two publications of a background save's progress.
PROGRESS_PUBLISH_INTERVAL_S = 1.0


class SaveMeter:
    """Step and save timings of one rank.

    Args:
        control_dir: the node's control directory; ``None`` when no supervisor runs
            (nothing is published then).
        publishes: whether this rank publishes (local rank 0 of its node).
        check_interval_steps: steps between two looks at a save request (reported as is).
        on_save_ended: called with the figures of every save that ended (keywords ``step``,
            ``reason``, ``committed``, ``background``, ``stall_s``, ``duration_s``,
            ``size_bytes``), on the thread that ended it; for the event log
            (:meth:`spotrun.train.events.TrainingEvents.save_ended`).
    """

    def __init__(
        self,
        control_dir: str | None,
        *,
        publishes: bool,
        check_interval_steps: int,
        on_save_ended: Callable[..., None] | None = None,
    ) -> None:
        self._control_dir = control_dir if publishes else None
        self._on_save_ended = on_save_ended
        self._check_interval_steps = check_interval_steps
        self._step_times_s: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._last_boundary_s: float | None = None
        self._recorded_step_time_s: float | None = None
        self._recent: list[control.SaveRecord] = []
        self._in_progress: control.SaveInProgress | None = None
        self._restore: control.RestoreRecord | None = None
        self._progress_published_s = 0.0
        self._lock = threading.Lock()  # a background save ends (and publishes) on its own thread
        self._steps_lock = threading.Lock()  # the step times alone: a step never waits for a publication

    @property
    def step_time_s(self) -> float | None:
        """Seconds one training step takes: the slowest of the last 16 steps (time in saves
        excluded); before two step boundaries were seen, the step time recorded in the
        restored checkpoint (:meth:`restored`), else ``None``."""
        with self._steps_lock:
            return max(self._step_times_s) if self._step_times_s else self._recorded_step_time_s

    def restored(self, recorded_step_time_s: float | None) -> None:
        """Take the step time recorded in the checkpoint just restored, in seconds."""
        self._recorded_step_time_s = recorded_step_time_s

    def restore_ended(self, step: int, duration_s: float, bytes_read: int) -> None:
        """Publish this launch's restore of ``step``: ``duration_s`` seconds, ``bytes_read``
        bytes read by this rank (shown by the supervisor's metrics)."""
        with self._lock:
            self._restore = control.RestoreRecord(
                step=step, duration_s=round(duration_s, 6), bytes_read=bytes_read, restored_unix_s=time.time()
            )
            self._publish()

    def step_boundary(self) -> None:
        """Call at each step boundary: the time since the previous one is a step's duration."""
        now_s = time.monotonic()
        if self._last_boundary_s is not None:
            with self._steps_lock:  # a background save's worker thread reads them when it publishes
                self._step_times_s.append(now_s - self._last_boundary_s)
        self._last_boundary_s = now_s

    def full_save_s(self) -> float | None:
        """Seconds the next full save should take (:func:`~spotrun.control.files.full_save_estimate` of this launch's
        saves); ``None`` before one committed."""
        with self._lock:
            estimate = control.full_save_estimate(self._recent)
        return None if estimate is None else estimate[2]

    def save_started(self, step: int, reason: str, *, background: bool = False) -> float:
        """Publish that the save of ``step`` started; returns its start (``time.monotonic()``)."""
        with self._lock:
            self._in_progress = control.SaveInProgress(
                step=step, reason=reason, started_unix_s=time.time(), background=background
            )
            self._progress_published_s = time.monotonic()
            self._publish()
        return time.monotonic()

    def stall_ended(self) -> None:
        """Training goes on while a background save is written: time blocked so far is not step time."""
        if self._last_boundary_s is not None:
            self._last_boundary_s = time.monotonic()

    def progress(self, step: int, bytes_done: int, bytes_total: int, remaining_s: float | None) -> None:
        """Publish the progress of the background save of ``step`` (about once a second at
        most: a call sooner after the last one does nothing).

        Args:
            bytes_done: bytes this rank wrote so far, of ``bytes_total``.
            remaining_s: seconds the rest of this rank's write should take; ``None`` when unknown.
        """
        if self._control_dir is None or time.monotonic() - self._progress_published_s < PROGRESS_PUBLISH_INTERVAL_S:
            return
        with self._lock:
            if self._in_progress is None or self._in_progress.step != step:
                return  # it ended meanwhile: never publish a finished save as in flight
            self._in_progress = dataclasses.replace(
                self._in_progress,
                bytes_done=bytes_done,
                bytes_total=bytes_total,
                remaining_s=None if remaining_s is None else round(remaining_s, 6),
                progress_unix_s=time.time(),
            )
            self._progress_published_s = time.monotonic()
            self._publish()

    def save_ended(
        self, step: int, reason: str, started_s: float, size_bytes: int | None, *, stall_s: float | None = None
    ) -> float:
        """Record the end of a save and publish it; returns its duration in seconds.

        Args:
            step: the saved step.
            reason: why it was saved.
            started_s: what :meth:`save_started` returned.
            size_bytes: bytes of all the step's shard files; ``None`` when the save failed
                (nothing is recorded then, only that no save is in progress).
            stall_s: for a background save (called from its worker thread), the seconds
                training was blocked by it; ``None`` for a synchronous save, which blocks
                training throughout (its duration is then no step time either).
        """
        now_s = time.monotonic()
        background = stall_s is not None
        if not background and self._last_boundary_s is not None:
            self._last_boundary_s = now_s  # time in the save is not step time
        duration_s = now_s - started_s
        with self._lock:
            if size_bytes is not None:
                self._recent = [
                    *self._recent,
                    control.SaveRecord(
                        step=step,
                        reason=reason,
                        size_bytes=size_bytes,
                        duration_s=round(duration_s, 6),
                        committed_unix_s=time.time(),
                        stall_s=round(duration_s if stall_s is None else stall_s, 6),
                        background=background,
                    ),
                ][-control.RECENT_SAVES :]
            self._in_progress = None
            self._publish()
        if self._on_save_ended is not None:
            self._on_save_ended(
                step=step,
                reason=reason,
                committed=size_bytes is not None,
                background=background,
                stall_s=duration_s if stall_s is None else stall_s,
                duration_s=duration_s,
                size_bytes=size_bytes,
            )
        return duration_s

    def _publish(self) -> None:
        """Write ``saves.json`` (the caller holds the lock)."""
        if self._control_dir is None:
            return
        try:
            control.write_save_stats(
                self._control_dir,
                control.SaveStats(
                    in_progress=self._in_progress,
                    recent=tuple(self._recent),
                    step_time_s=self.step_time_s,
                    check_interval_steps=self._check_interval_steps,
                    restore=self._restore,
                ),
            )
        except OSError as exc:  # the supervisor then estimates from less; training goes on
            log.warning("cannot write the save measurements for the supervisor: %s", exc)
