"""How long an emergency save would take, and whether it fits before the deadline.

The supervisor decides this when a stop notice arrives: the save in progress, the steps to the
next boundary and the save itself, each from this launch's measured saves (``saves.json``) or
else from the resumed checkpoint's ``timing``; with no measurement the save is asked for
anyway. The model: ``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotrun.checkpoint.in_flight import Choice, choose
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_layout import ranks
from spotrun.control.files import SaveInProgress, SaveStats, full_save_estimate

#: Seconds added to a manifest's recorded shard-write time for the rest of a save (the
#: collectives, the manifest's conditional put), when no whole save was measured yet.
COMMIT_ALLOWANCE_S = 1.0
#: Seconds assumed for reaching the next step boundary when the step time is unknown.
UNKNOWN_STEP_TIME_S = 0.0


@dataclass(frozen=True)
class SaveEstimate:
    """An estimate of the time from "now" to the commit of an emergency checkpoint.

    Attributes:
        in_flight_s: seconds until the save now in progress finishes (0 if none).
        in_flight_step: the step being saved now, if any.
        boundary_s: seconds until the workers reach the step boundary where they look at
            the request (``check_interval_steps`` steps).
        save_s: seconds the emergency save itself takes.
        size_bytes: bytes the save writes (all ranks).
        throughput_bytes_per_s: the slowest measured save throughput.
        basis: where the figures come from, for the log (``"3 saves of this launch"``).
        allowance_s: seconds of ``save_s`` that are :data:`COMMIT_ALLOWANCE_S` rather than
            measured (an estimate from a manifest's shard-write time); 0 otherwise.
        in_flight_background: the save in progress runs in the background (the workers reach
            the step boundary meanwhile, and may abandon it).
        write_scaled: for the log, how a manifest's shard-write time was scaled for fewer ranks
            now (``"x 4/2: saved by 4 ranks, 2 now"``); ``None`` when it was not.
        in_flight_written: for the log, how much of a background save in flight is written
            (``"1.2 of 3.0 MiB written"``); ``None`` when not known.
    """

    in_flight_s: float
    in_flight_step: int | None
    boundary_s: float
    save_s: float
    size_bytes: int
    throughput_bytes_per_s: float
    basis: str
    allowance_s: float = 0.0
    write_scaled: str | None = None
    in_flight_background: bool = False
    in_flight_written: str | None = None

    @property
    def total_s(self) -> float:
        """Seconds from now to the emergency checkpoint's commit, the save in progress finished first."""
        if self.in_flight_background:
            return max(self.in_flight_s, self.boundary_s) + self.save_s
        return self.in_flight_s + self.boundary_s + self.save_s

    def choice(self, left_s: float) -> Choice:
        """What becomes of a save in progress with ``left_s`` seconds left (:func:`decide`)."""
        if self.in_flight_step is None or not self.in_flight_background:
            # nothing in flight, or a synchronous save the workers are in: it ends before they see the request
            return Choice.FINISH_THEN_SAVE if self.total_s <= left_s else Choice.FINISH_ONLY
        return choose(self.in_flight_s, self.save_s, left_s, boundary_s=self.boundary_s)

    def describe(self) -> str:
        """One line for the log: the total and how it is made up."""
        parts = []
        if self.in_flight_step is not None and self.in_flight_background:
            written = f" ({self.in_flight_written})" if self.in_flight_written else ""
            parts.append(
                f"{self.in_flight_s:.1f} s to finish the background save of step {self.in_flight_step} "
                f"in flight{written}"
            )
        elif self.in_flight_step is not None:
            parts.append(f"{self.in_flight_s:.1f} s to finish the save of step {self.in_flight_step} in progress")
        parts.append(f"{self.boundary_s:.1f} s to the next step boundary")
        if self.allowance_s:
            scaled = f" ({self.write_scaled})" if self.write_scaled else ""
            parts.append(
                f"{self.save_s:.1f} s to save {amount(self.size_bytes)}: the recorded shard write of "
                f"{self.save_s - self.allowance_s:.1f} s{scaled} + {self.allowance_s:.1f} s allowed for "
                "the commit"
            )
        else:
            parts.append(
                f"{self.save_s:.1f} s to save {amount(self.size_bytes)} at {amount(self.throughput_bytes_per_s)}/s"
            )
        # a background save in flight goes on while the workers reach the boundary: the longer of the two counts
        how = (
            "the longer of the first two, then the save"
            if self.in_flight_step is not None and self.in_flight_background
            else "in sequence"
        )
        return f"{self.total_s:.1f} s ({', '.join(parts)}: {how}; from {self.basis})"


def estimate_emergency_save(
    stats: SaveStats | None,
    resumed: Manifest | None,
    now_unix_s: float,
    *,
    ranks_now: int | None = None,
) -> SaveEstimate | None:
    """Estimate the emergency save from the measurements at hand (see the module docstring).

    Args:
        stats: this launch's measurements (``saves.json``), or ``None``.
        resumed: the manifest of the checkpoint this launch resumed from, or ``None``.
        now_unix_s: the current time, seconds since the epoch.
        ranks_now: the ranks this launch starts (the fewest, for an elastic range); ``None``
            when unknown. Scales an estimate from ``resumed`` saved by more ranks.

    Returns:
        The estimate, or ``None`` when nothing was measured yet.
    """
    step_time_s = stats.step_time_s if stats is not None else None
    check_interval_steps = stats.check_interval_steps if stats is not None else 1
    measured = full_save_estimate(stats.recent) if stats is not None else None
    scaled = None  # how a manifest's write time was scaled, for the log
    if measured is not None:
        size_bytes, throughput, save_s = measured
        n = len(stats.recent)
        basis = f"{n} save{'s' if n > 1 else ''} of this launch"
    elif resumed is not None and resumed.timing is not None:
        size_bytes = resumed.size_bytes
        scale = resumed.world_size / ranks_now if ranks_now and resumed.world_size > ranks_now else 1.0
        save_s = resumed.timing.write_s * scale + COMMIT_ALLOWANCE_S
        throughput = _throughput(size_bytes, save_s)
        basis = f"the manifest of step {resumed.step}"
        if scale != 1.0:
            scaled = f"x {resumed.world_size}/{ranks_now}: saved by {resumed.world_size} ranks, {ranks(ranks_now)} now"
        if step_time_s is None:
            step_time_s = resumed.timing.step_time_s
    else:
        return None
    allowance_s = 0.0 if measured is not None else COMMIT_ALLOWANCE_S
    in_progress = stats.in_progress if stats is not None else None
    in_flight_s = 0.0 if in_progress is None else _in_flight_s(in_progress, save_s, now_unix_s)
    step_s = UNKNOWN_STEP_TIME_S if step_time_s is None else step_time_s
    return SaveEstimate(
        in_flight_s=in_flight_s,
        in_flight_step=None if in_progress is None else in_progress.step,
        boundary_s=step_s * check_interval_steps,
        save_s=save_s,
        size_bytes=size_bytes,
        throughput_bytes_per_s=throughput,
        basis=basis,
        allowance_s=allowance_s,
        write_scaled=scaled,
        in_flight_background=in_progress is not None and in_progress.background,
        in_flight_written=None
        if in_progress is None or not in_progress.bytes_total
        else f"{amount(in_progress.bytes_done)} of {amount(in_progress.bytes_total)} written",
    )


def _in_flight_s(in_progress: SaveInProgress, save_s: float, now_unix_s: float) -> float:
    """Seconds until the save in progress ends: what its writer last published it still needs
    (less the time since), else a whole save less the time it has run."""
    if in_progress.remaining_s is not None and in_progress.progress_unix_s is not None:
        return max(0.0, in_progress.remaining_s - max(0.0, now_unix_s - in_progress.progress_unix_s))
    return max(0.0, save_s - max(0.0, now_unix_s - in_progress.started_unix_s))


@dataclass(frozen=True)
class Decision:
    """The supervisor's answer to a stop notice.

    Attributes:
        save: ask the workers for an emergency checkpoint (else: stop without one).
        choice: what becomes of a save in progress (:class:`~spotrun.checkpoint.in_flight.Choice`).
        message: the log line that says which, and why.
    """

    save: bool
    choice: Choice
    message: str


def decide(estimate: SaveEstimate, left_s: float) -> Decision:
    """Whether to ask for an emergency save with ``left_s`` seconds before the deadline.

    Asked for when the save fits after the save in progress (if any), or - with a background
    save in flight - when the workers can abandon that one and save in time (they decide
    again at the step boundary, from fresher figures). Otherwise not: the workers stop at
    their next step boundary without saving, after the save in progress commits when it
    fits (a background save that cannot commit in time is abandoned).
    """
    choice = estimate.choice(left_s)
    step = estimate.in_flight_step
    left = f"the {left_s:.1f} s left before the deadline"
    if choice is Choice.FINISH_THEN_SAVE:
        first = f" (after the save of step {step} in flight commits)" if step is not None else ""
        return Decision(
            True, choice, f"emergency checkpoint requested: estimated {estimate.describe()} fits in {left}{first}"
        )
    if choice is Choice.ABANDON_AND_SAVE:
        return Decision(
            True,
            choice,
            (
                f"emergency checkpoint requested: finishing the background save of step {step} in flight first "
                f"would take {estimate.describe()}, more than {left}; the workers abandon it and save the current "
                f"step ({estimate.boundary_s + estimate.save_s:.1f} s)"
            ),
        )
    if choice is Choice.FINISH_ONLY and step is not None:
        after = f"after the save of step {step} in progress commits, "
    elif step is not None:
        after = f"abandoning the background save of step {step} in flight (it cannot commit in time either), "
    else:
        after = ""
    return Decision(
        False,
        choice,
        (
            f"NOT saving: an emergency checkpoint would take {estimate.describe()}, more than {left}; the workers "
            f"stop {after}at their next step boundary without saving, and the newest complete checkpoint stays "
            "the resume point"
        ),
    )


def _throughput(size_bytes: int, duration_s: float) -> float:
    return max(size_bytes, 1) / max(duration_s, 1e-6)


def amount(size_bytes: float) -> str:
    """``"512 KiB"``, ``"3.2 MiB"``, ``"1.5 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes / 2**10:.0f} KiB"
