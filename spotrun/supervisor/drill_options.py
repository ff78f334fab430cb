"""Options and report of ``spotrun drill`` (the phases are in :mod:`spotrun.supervisor.drill`)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from spotrun.env import DEFAULT_CHECKPOINT_URI
from spotrun.errors import ConfigError
from spotrun.supervisor.config import storage_options

CLOUDS = ("aws", "gcp", "azure", "signal")
#: The lead each cloud gives, in seconds: AWS about 2 minutes, Azure at least 30 s, GCP and a
#: Kubernetes/systemd SIGTERM about 30 s. The drill's notice gives the same.
CLOUD_LEAD_S = {"aws": 120.0, "azure": 30.0, "gcp": 30.0, "signal": 30.0}
#: This VM's name in the fake Azure events.
DRILL_VM_NAME = "spotrun-drill"
#: Trigger used when neither ``after_steps`` nor ``after_s`` is given, in seconds.
DEFAULT_AFTER_S = 60.0
#: At most this many differences are listed in a report (``difference_count`` has them all).
MAX_REPORTED_DIFFERENCES = 10


@dataclass(frozen=True)
class DrillConfig:
    """Options of ``spotrun drill``.

    Attributes:
        command: the launch command (``["torchrun", ...]``).
        cloud: whose notice to rehearse: ``aws``, ``gcp``, ``azure`` or ``signal``.
        after_steps: serve the notice once a checkpoint of a step >= this is complete.
        after_s: serve the notice this many seconds after the launch (default 60 when
            ``after_steps`` is not given either).
        checkpoint_uri: checkpoint root of the job.
        s3_endpoint_url: S3 endpoint for an ``s3://`` URI (as ``spotrun run``).
        grace_period_s: seconds from the notice to the (pretend) end of the machine;
            ``None``: the cloud's own lead (:data:`CLOUD_LEAD_S`). A GCP notice carries no
            time: the supervisor gives it its 30 s window whatever this says.
        restart_timeout_s: seconds the restarted job may take to start, restore, run one
            step and save it. The reference run gets this plus twice phase 1's duration.
        exact_check: run phase 3, the uninterrupted reference run, and compare.
        reference_uri: the reference run's checkpoint root (must hold no objects);
            ``None``: a temporary directory for a local ``checkpoint_uri``,
            ``s3://bucket/prefix-drill-reference/<random>`` for ``s3://bucket/prefix``.
        keep_reference: leave the reference run's checkpoints in place (the report names them).
        log_format: ``--log-format`` of every ``spotrun run`` it starts; ``None``: their default.

    Raises:
        ConfigError: no command, an unknown cloud, both or bad triggers, bad durations, a
            bad ``reference_uri`` (also: the same as ``checkpoint_uri``, or given without
            the exact check).
    """

    command: tuple[str, ...]
    cloud: str = "aws"
    after_steps: int | None = None
    after_s: float | None = None
    checkpoint_uri: str = DEFAULT_CHECKPOINT_URI
    s3_endpoint_url: str | None = None
    grace_period_s: float | None = None
    restart_timeout_s: float = 600.0
    exact_check: bool = True
    reference_uri: str | None = None
    keep_reference: bool = False
    log_format: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ConfigError("no launch command given: use spotrun drill [options] -- COMMAND...")
        if self.cloud not in CLOUDS:
            raise ConfigError(f"--cloud must be one of {', '.join(CLOUDS)}, got {self.cloud!r}")
        if self.after_steps is not None and self.after_s is not None:
            raise ConfigError("give --after-steps or --after-s, not both")
        if self.after_steps is not None and self.after_steps < 1:
            raise ConfigError(f"--after-steps must be >= 1, got {self.after_steps}")
        for name in ("after_s", "grace_period_s", "restart_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"drill option {name} must be > 0, got {value}")
        storage_options(self.checkpoint_uri, s3_endpoint_url=self.s3_endpoint_url)
        if not self.exact_check and (self.reference_uri is not None or self.keep_reference):
            raise ConfigError("--reference-uri and --keep-reference need the exact check (drop --no-exact-check)")
        if self.reference_uri is not None:
            if not self.reference_uri.strip():
                raise ConfigError("--reference-uri is empty")
            storage_options(self.reference_uri, s3_endpoint_url=self.s3_endpoint_url)
            if _normalised(self.reference_uri) == _normalised(self.checkpoint_uri):
                raise ConfigError(f"--reference-uri must differ from --checkpoint-uri, both are {self.reference_uri}")

    @property
    def lead_s(self) -> float:
        """Seconds between the drill's notice and its deadline."""
        return self.grace_period_s if self.grace_period_s is not None else CLOUD_LEAD_S[self.cloud]


def _normalised(uri: str) -> str:
    """A URI in one spelling per root: local paths absolute, no trailing ``/``."""
    uri = uri.strip()
    if uri.startswith("s3://"):
        return uri.rstrip("/")
    return os.path.abspath(os.path.expanduser(uri.removeprefix("file://")))


@dataclass
class DrillReport:
    """What a drill found. Times are seconds since the epoch; ``None`` where a phase never got there.

    Attributes:
        cloud: the rehearsed notice.
        problems: why the drill failed, one line each; empty when it passed.
        start_step: R0, the newest complete step before phase 1 (``None``: a fresh start).
        launch_unix_s: when phase 1 launched the job.
        notice_unix_s: when the fake served the notice (or the SIGTERM was sent).
        newest_step_at_notice: the newest complete step when the notice was served.
        first_exit_code: exit code of ``spotrun run`` after the notice (143 expected).
        emergency_step: the newest complete step after phase 1: what the notice saved.
        emergency_reason: its manifest's reason (``emergency``; ``periodic`` if the notice
            came at a step that a periodic save had just taken).
        commit_unix_s: its manifest's creation time (the commit follows within the write).
        exit_unix_s: when ``spotrun run`` exited after the notice.
        acknowledged_unix_s: Azure only: when the StartRequests POST arrived.
        resume_step: the step the restart resumed from (the supervisor's choice).
        restart_unix_s: when the restart was launched.
        restart_exit_code: exit code of the restart (143: it saved step E + 1 and stopped).
        first_step_after_restart: the step the restart saved first (E + 1 expected).
        first_save_unix_s: that checkpoint's creation time.
        exact: whether step E + 1 of the resumed run is bit-identical, on every rank, to that
            of the uninterrupted reference run; ``None`` when not checked (``--no-exact-check``,
            an earlier phase failed, or the reference run saved no step E + 1).
        differences: the first :data:`MAX_REPORTED_DIFFERENCES` differences, each
            ``{"key", "what", "max_abs_diff"}`` (see :class:`~spotrun.supervisor.drill_reference.Difference`).
        difference_count: how many values differ in all; ``None`` when not checked.
        reference_uri: the reference run's checkpoint root (deleted afterwards unless kept).
        reference_kept: whether that root was left in place.
        reference_unix_s: when the reference run was launched (after step R0 was copied).
        reference_exit_unix_s: when it exited.
        reference_exit_code: its ``spotrun run`` exit code (143: it stopped at step E + 1).
    """

    cloud: str
    problems: list[str] = field(default_factory=list)
    start_step: int | None = None
    launch_unix_s: float | None = None
    notice_unix_s: float | None = None
    newest_step_at_notice: int | None = None
    first_exit_code: int | None = None
    emergency_step: int | None = None
    emergency_reason: str | None = None
    commit_unix_s: float | None = None
    exit_unix_s: float | None = None
    acknowledged_unix_s: float | None = None
    resume_step: int | None = None
    restart_unix_s: float | None = None
    restart_exit_code: int | None = None
    first_step_after_restart: int | None = None
    first_save_unix_s: float | None = None
    exact: bool | None = None
    differences: list[dict] = field(default_factory=list)
    difference_count: int | None = None
    reference_uri: str | None = None
    reference_kept: bool = False
    reference_unix_s: float | None = None
    reference_exit_unix_s: float | None = None
    reference_exit_code: int | None = None

    @property
    def passed(self) -> bool:
        """True when every check held."""
        return not self.problems

    def phases_s(self) -> dict[str, float | None]:
        """Durations in seconds: notice -> commit (0 if the step was saved already),
        commit -> exit of ``spotrun run``, restart -> first step saved, and the reference
        run (launch -> exit)."""
        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else round(max(0.0, end - start), 3)

        return {
            "notice_to_commit_s": span(self.notice_unix_s, self.commit_unix_s),
            "commit_to_exit_s": span(self.commit_unix_s, self.exit_unix_s),
            "restart_to_first_step_saved_s": span(self.restart_unix_s, self.first_save_unix_s),
            "reference_s": span(self.reference_unix_s, self.reference_exit_unix_s),
        }

    def _exact_summary(self) -> str:
        start = "a fresh start" if self.start_step is None else f"step {self.start_step}"
        if self.exact is None:
            return "not checked"
        step = self.first_step_after_restart
        if self.exact:
            return f"step {step} is bit-identical on every rank to an uninterrupted run from {start}"
        return f"NO: step {step} differs from an uninterrupted run from {start} in {self.difference_count} value(s)"

    def to_json(self) -> dict:
        """The report as JSON values (what ``spotrun drill --json`` prints)."""
        return {**asdict(self), "passed": self.passed, "phases_s": self.phases_s()}

    def summary(self) -> str:
        """A few lines for people."""
        phases = self.phases_s()

        def seconds(name: str) -> str:
            return "-" if phases[name] is None else f"{phases[name]:.2f} s"

        def shown(value: object) -> str:
            return "-" if value is None else str(value)

        lines = [
            f"drill ({self.cloud} notice): {'PASSED' if self.passed else 'FAILED'}",
            f"  emergency checkpoint: step {shown(self.emergency_step)} ({shown(self.emergency_reason)}), "
            f"spotrun run exited {shown(self.first_exit_code)}",
            f"  restart: resumed from step {shown(self.resume_step)}, "
            f"first step saved {shown(self.first_step_after_restart)}, exited {shown(self.restart_exit_code)}",
            f"  notice -> commit {seconds('notice_to_commit_s')}, commit -> exit {seconds('commit_to_exit_s')}, "
            f"restart -> first step saved {seconds('restart_to_first_step_saved_s')}",
        ]
        if self.acknowledged_unix_s is not None and self.commit_unix_s is not None:
            lines.append(f"  azure event acknowledged {self.acknowledged_unix_s - self.commit_unix_s:.2f} s after the commit")
        lines.append(f"  exact resume: {self._exact_summary()}, reference run {seconds('reference_s')}")
        lines.extend(f"    differs: {d['key']}: {d['what']}"
                     + ("" if d["max_abs_diff"] is None else f", max abs difference {d['max_abs_diff']:.3g}")
                     for d in self.differences)
        if self.difference_count is not None and self.difference_count > len(self.differences):
            lines.append(f"    ... and {self.difference_count - len(self.differences)} more")
        if self.reference_kept:
            lines.append(f"  reference checkpoints kept under {self.reference_uri}")
        lines.extend(f"  problem: {p}" for p in self.problems)
        return "\n".join(lines)
