"""What ``spotrun drill`` found: :class:`DrillReport`, as JSON and as a few lines for people."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: At most this many differences are listed in a report (``difference_count`` has them all).
MAX_REPORTED_DIFFERENCES = 10


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
            ``{"key", "what", "max_abs_diff", "max_relative_diff"}`` (see :class:`~spotrun.drill.compare.Difference`).
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
            lines.append(
                f"  azure event acknowledged {self.acknowledged_unix_s - self.commit_unix_s:.2f} s after the commit"
            )
        lines.append(f"  exact resume: {self._exact_summary()}, reference run {seconds('reference_s')}")
        lines.extend(
            f"    differs: {d['key']}: {d['what']}"
            + ("" if d["max_abs_diff"] is None else f", max abs difference {d['max_abs_diff']:.3g}")
            for d in self.differences
        )
        if self.difference_count is not None and self.difference_count > len(self.differences):
            lines.append(f"    ... and {self.difference_count - len(self.differences)} more")
        if self.reference_kept:
            lines.append(f"  reference checkpoints kept under {self.reference_uri}")
        lines.extend(f"  problem: {p}" for p in self.problems)
        return "\n".join(lines)
