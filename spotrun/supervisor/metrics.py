"""Prometheus metrics of one ``spotrun run`` supervisor (one node).

:class:`SupervisorMetrics` observes the supervisor's events and re-reads the workers'
``saves.json``, as a collector in a registry of its own; :mod:`spotrun.supervisor.metrics_export`
serves it. Every metric and where its figures come from: docs/operations/metrics.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from spotrun.checkpoint import catalog
from spotrun.control import files as control
from spotrun.errors import SpotrunError
from spotrun.storage import LocalStorage

log = logging.getLogger(__name__)

#: Histogram buckets of save durations and stalls, in seconds (a stall of 10 ms to a save of 30 min).
SAVE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, doc, labels, registry=None)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, labels, registry=None)


class SupervisorMetrics:
    """The supervisor's metrics: an observer of its events and the collector of :attr:`registry`.

    Args:
        clock: seconds since the epoch (for the age of the newest step); injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # events come on the supervisor's thread, collections on others
        self._control_dir: str | None = None
        self._counted_saves: set[tuple[int, float]] = set()  # (step, committed_unix_s) of this launch
        self._newest: tuple[int, float] | None = None  # (step, committed_unix_s)
        self._fast_tier_dir: str | None = None  # the steps root of this run's fast tier, if it has one
        self._declare_launch_metrics()
        self._declare_save_metrics()
        self._declare_notice_and_exit_metrics()
        self._declare_fast_tier_metrics()
        self._set_gauges: set[Gauge] = set()  # a gauge is shown once set: absent means not known yet
        self._always = [  # counters and histograms: 0 is a true count
            self.launches,
            self.saves,
            self.save_duration,
            self.save_stall,
            self.saved_bytes,
            self.notices,
            self.decisions,
            self.restarts,
        ]
        self._gauges = [  # in the order shown
            self.start_time,
            self.incarnation,
            self.resumed_step,
            self.step_time,
            self.last_save_duration,
            self.last_save_size,
            self.last_restore_duration,
            self.last_restore_bytes,
            self.command_exit_code,
            self.newest_step,
            self.newest_time,
            self.newest_age,
            self.fast_tier_newest_step,
            self.fast_tier_age,
            self.fast_tier_size,
            self.exit_code,
            self.exit_reason,
        ]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _declare_launch_metrics(self) -> None:
        self.start_time = _gauge("spotrun_start_time_seconds", "When this supervisor started (Unix time).")
        self.launches = _counter("spotrun_launches", "Launches of the command (first start and restarts).")
        self.incarnation = _gauge("spotrun_incarnation", "Incarnation of the current (last) launch.")
        self.resumed_step = _gauge("spotrun_resumed_step", "Step the current launch resumed from (0: fresh start).")
        self.newest_step = _gauge("spotrun_newest_complete_step", "Newest step this node knows complete.")
        self.newest_time = _gauge(
            "spotrun_newest_complete_step_timestamp_seconds", "When the newest complete step was committed (Unix time)."
        )
        self.newest_age = _gauge(
            "spotrun_newest_complete_step_age_seconds", "Seconds since the newest complete step was committed."
        )
        self.step_time = _gauge("spotrun_step_time_seconds", "Seconds per training step (slowest of the last 16).")

    def _declare_save_metrics(self) -> None:
        self.saves = _counter("spotrun_saves", "Committed saves, by reason.", ("reason",))
        self.save_duration = Histogram(
            "spotrun_save_duration_seconds",
            "Seconds from a save's start to its commit.",
            buckets=SAVE_BUCKETS_S,
            registry=None,
        )
        self.save_stall = Histogram(
            "spotrun_save_stall_seconds",
            "Seconds training was blocked by a save.",
            buckets=SAVE_BUCKETS_S,
            registry=None,
        )
        self.saved_bytes = _counter("spotrun_saved_bytes", "Bytes of the shard files of all committed saves.")
        self.last_save_duration = _gauge("spotrun_last_save_duration_seconds", "The newest save's duration.")
        self.last_save_size = _gauge("spotrun_last_save_size_bytes", "The newest save's shard bytes (all ranks).")
        self.last_restore_duration = _gauge(
            "spotrun_last_restore_duration_seconds", "Seconds the newest restore took (local rank 0)."
        )
        self.last_restore_bytes = _gauge(
            "spotrun_last_restore_read_bytes", "Bytes local rank 0 read in the newest restore."
        )

    def _declare_notice_and_exit_metrics(self) -> None:
        self.notices = _counter("spotrun_notices", "Preemption notices, by source.", ("source",))
        self.decisions = _counter(
            "spotrun_emergency_save_decisions",
            "Decisions after a notice: save, save_to_memory (the fast tier, copied to a node) or stop_without_save.",
            ("decision",),
        )
        self.restarts = _counter("spotrun_restarts", "Restarts after a crash.")
        self.command_exit_code = _gauge("spotrun_last_command_exit_code", "Exit code of the command's last launch.")
        self.exit_code = _gauge("spotrun_exit_code", "spotrun's exit code (once it exited).")
        self.exit_reason = _gauge("spotrun_exit_reason", "1 for the reason spotrun exited.", ("reason",))

    def _declare_fast_tier_metrics(self) -> None:
        self.fast_tier_newest_step = _gauge(
            "spotrun_fast_tier_newest_complete_step", "Newest complete step in this node's fast tier."
        )
        self.fast_tier_age = _gauge(
            "spotrun_fast_tier_age_seconds", "Seconds since the fast tier's newest complete step was committed."
        )
        self.fast_tier_size = _gauge("spotrun_fast_tier_size_bytes", "Bytes this node's fast tier holds.")

    # --- observer -----------------------------------------------------------------

    def event(self, name: str, fields: dict[str, Any]) -> None:
        """Take one supervisor event (see :mod:`spotrun.supervisor.observers`)."""
        with self._lock:
            handler = getattr(self, f"_on_{name}", None)
            if handler is not None:
                handler(fields)

    def close(self) -> None:
        """Nothing to release (the exporters own the outputs)."""

    def _on_start(self, fields: dict[str, Any]) -> None:
        self._set(self.start_time, fields["time_unix_s"])

    def _on_launch(self, fields: dict[str, Any]) -> None:
        self.launches.inc()
        self._set(self.incarnation, fields["incarnation"])
        self._control_dir = fields.get("control_dir")
        self._fast_tier_dir = fields.get("fast_tier_dir")
        self._counted_saves = set()
        step = fields.get("resumed_step")
        self._set(self.resumed_step, step or 0)
        created_unix_s = fields.get("resumed_created_unix_s")
        if step is not None and created_unix_s is not None:
            self._complete(step, created_unix_s)

    def _on_notice(self, fields: dict[str, Any]) -> None:
        self.notices.labels(source=fields["source"]).inc()

    def _on_decision(self, fields: dict[str, Any]) -> None:
        if not fields["save"]:
            decision = "stop_without_save"
        else:
            decision = "save_to_memory" if fields.get("tier") == "memory" else "save"
        self.decisions.labels(decision=decision).inc()

    def _on_command_exit(self, fields: dict[str, Any]) -> None:
        self._set(self.command_exit_code, fields["code"])
        self._refresh()  # the launch's last measurements, before a restart starts another

    def _on_restart(self, fields: dict[str, Any]) -> None:
        self.restarts.inc()

    def _on_exit(self, fields: dict[str, Any]) -> None:
        self._refresh()
        if fields.get("step") is not None and self._control_dir is not None:
            report = _quietly(control.read_commit_report, self._control_dir)
            if report is not None and report.step == fields["step"]:
                self._complete(report.step, report.committed_unix_s)
        if fields.get("code") is not None:
            self._set(self.exit_code, fields["code"])
        self.exit_reason.labels(reason=fields["reason"]).set(1)
        self._set_gauges.add(self.exit_reason)

    # --- measurements of the workers -------------------------------------------------

    def refresh(self) -> None:
        """Read the workers' measurements of the current launch again (cheap: one small file)."""
        with self._lock:
            self._refresh()

    def _set(self, gauge: Gauge, value: float) -> None:
        gauge.set(value)
        self._set_gauges.add(gauge)

    def _complete(self, step: int, committed_unix_s: float) -> None:
        if self._newest is None or (step, committed_unix_s) > self._newest:
            self._newest = (step, committed_unix_s)
            self._set(self.newest_step, step)
            self._set(self.newest_time, committed_unix_s)

    def _refresh(self) -> None:
        """Read ``saves.json`` of the current launch; count the saves not counted yet."""
        if self._control_dir is None:
            return
        stats = _quietly(control.read_save_stats, self._control_dir)
        if stats is None:
            return
        if stats.step_time_s is not None:
            self._set(self.step_time, stats.step_time_s)
        if stats.restore is not None:
            self._set(self.last_restore_duration, stats.restore.duration_s)
            self._set(self.last_restore_bytes, stats.restore.bytes_read)
        for record in stats.recent:
            key = (record.step, record.committed_unix_s)
            if key in self._counted_saves:
                continue
            self._counted_saves.add(key)
            self.saves.labels(reason=record.reason).inc()
            self.save_duration.observe(record.duration_s)
            self.save_stall.observe(record.duration_s if record.stall_s is None else record.stall_s)
            self.saved_bytes.inc(record.size_bytes)
            self._set(self.last_save_duration, record.duration_s)
            self._set(self.last_save_size, record.size_bytes)
            self._complete(record.step, record.committed_unix_s)

    # --- collector ---------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """Every metric, with the workers' measurements read again first."""
        with self._lock:
            self._refresh()
            if self._newest is not None:
                self._set(self.newest_age, max(0.0, self._clock() - self._newest[1]))
            self._read_fast_tier()
            shown = [*self._always, *(g for g in self._gauges if g in self._set_gauges)]
            families = [family for metric in shown for family in metric.collect()]
        yield from families

    def _read_fast_tier(self) -> None:
        """The fast tier's newest complete step, its age and the tier's bytes, from its directory
        (the caller holds the lock). Once the tier is released (the supervisor's exit): 0 bytes, no step."""
        root = self._fast_tier_dir
        if root is None:
            return
        if not os.path.isdir(root):
            self._set(self.fast_tier_size, 0)
            self._set_gauges.difference_update((self.fast_tier_newest_step, self.fast_tier_age))
            return
        self._set(self.fast_tier_size, _bytes_under(root))
        try:
            steps = catalog.list_steps(LocalStorage(root))
        except (SpotrunError, OSError) as exc:  # a step deleted while listed: the next collection sees it
            log.debug("metrics: listing the fast tier %s: %s", root, exc)
            return
        complete = [s for s in steps if s.status == catalog.COMPLETE]
        if complete:
            self._set(self.fast_tier_newest_step, complete[-1].step)
            self._set(self.fast_tier_age, max(0.0, self._clock() - complete[-1].newest_object_unix_s))


def _bytes_under(root: str) -> int:
    """Bytes of the files under ``root`` (files deleted meanwhile not counted)."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _quietly(read: Callable[[str], Any], control_dir: str) -> Any:
    """``read(control_dir)``, or ``None`` (logged at debug) when the file is malformed."""
    try:
        return read(control_dir)
    except SpotrunError as exc:
        log.debug("metrics: %s", exc)
        return None
