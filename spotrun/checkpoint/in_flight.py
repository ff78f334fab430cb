"""What to do with a background save in flight when the job must stop before a deadline.

One rule (:func:`choose`) serves the supervisor when a notice arrives
(:mod:`spotrun.supervisor.estimate`) and the workers at the step boundary where they stop
(:func:`decide`), so both decide alike: finish the save in flight and save the current step
when both fit, else the best of the two that fits. Nothing here imports torch. The order of
preference: ``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """What happens to a background save in flight when the job stops."""

    FINISH_THEN_SAVE = "finish-then-save"
    FINISH_ONLY = "finish-only"
    ABANDON_AND_SAVE = "abandon-and-save"
    FINISH_ANYWAY = "finish-anyway"
    ABANDON = "abandon"  # stopping without a save: the save in flight cannot commit in time

    @property
    def saves_current_step(self) -> bool:
        """Whether the current step is saved after the save in flight is settled."""
        return self in (Choice.FINISH_THEN_SAVE, Choice.ABANDON_AND_SAVE)

    @property
    def abandons(self) -> bool:
        """Whether the save in flight is abandoned."""
        return self in (Choice.ABANDON_AND_SAVE, Choice.ABANDON)


def choose(
    in_flight_s: float | None, save_s: float | None, left_s: float, *, boundary_s: float = 0.0, may_save: bool = True
) -> Choice:
    """The rule of the module docstring.

    Args:
        in_flight_s: seconds until the save in flight commits; ``None`` when unknown.
        save_s: seconds a full save of the current step takes; ``None`` when unknown.
        left_s: seconds left before the deadline.
        boundary_s: seconds until the workers reach the step boundary where they stop (the
            save in flight goes on meanwhile); 0 at the boundary.
        may_save: False when the workers stop without saving (then only
            :attr:`Choice.FINISH_ONLY` or :attr:`Choice.ABANDON`).
    """
    flight_s = max(in_flight_s or 0.0, boundary_s)
    save_s = save_s or 0.0
    if not may_save:
        return Choice.FINISH_ONLY if flight_s <= left_s else Choice.ABANDON
    if flight_s + save_s <= left_s:
        return Choice.FINISH_THEN_SAVE
    if flight_s <= left_s:
        return Choice.FINISH_ONLY
    if boundary_s + save_s <= left_s:
        return Choice.ABANDON_AND_SAVE
    return Choice.FINISH_ANYWAY


def decide(everyone: list[dict], step: int, left_s: float, full_save_s: float | None, may_save: bool) -> dict:
    """The workers' choice (rank 0 decides, :func:`spotrun.checkpoint.background.settle` broadcasts):
    ``{"choice": Choice value, "why": log line or None (nothing was being written)}``, from
    every rank's ``{"step", "running", "remaining_s", "elapsed_s"}`` (the step in flight,
    whether it is still being written, the seconds its write still needs - ``None`` before
    any byte was written - and the seconds since it started).

    Args:
        step: the current step.
        left_s: seconds left before the deadline.
        full_save_s: seconds a full save takes, as measured by this launch; ``None`` when
            nothing was measured (the save in flight's own pace is used, when known).
        may_save: whether the current step may be saved (False: stopping without a save).
    """
    running = [r for r in everyone if r["running"]]
    if not running:  # nothing in flight, or it ended everywhere: its outcome is acted on as usual
        return {"choice": Choice.FINISH_THEN_SAVE.value if may_save else Choice.FINISH_ONLY.value, "why": None}
    in_flight_step = running[0]["step"]
    if full_save_s is None:  # this launch committed nothing yet: the save in flight's own pace
        projected = [r["elapsed_s"] + r["remaining_s"] for r in running if r["remaining_s"] is not None]
        full_save_s = max(projected) if projected else None
    in_flight = []
    for r in running:
        if r["remaining_s"] is not None:
            in_flight.append(r["remaining_s"])
        elif full_save_s is not None:  # nothing written yet on that rank: a whole save, less what ran
            in_flight.append(max(0.0, full_save_s - r["elapsed_s"]))
    in_flight_s = max(in_flight) if len(in_flight) == len(running) else None
    choice = choose(in_flight_s, full_save_s, left_s, may_save=may_save)
    figures = (
        f"{_seconds(in_flight_s)} to finish it (slowest rank), {_seconds(full_save_s)} for a full save, "
        f"{left_s:.1f} s left before the deadline"
    )
    what = {
        Choice.FINISH_THEN_SAVE: f"finishing it, then saving step {step}",
        Choice.FINISH_ONLY: (
            f"finishing it; step {step} is NOT saved (finishing it and then saving would not "
            f"fit): step {in_flight_step} is the resume point if it commits"
        )
        if may_save
        else f"finishing it, then stopping without a save of step {step}",
        Choice.ABANDON_AND_SAVE: f"abandoning it (it would not commit in time) and saving step {step} instead",
        Choice.FINISH_ANYWAY: f"neither fits; finishing it anyway: step {step} is NOT saved",
        Choice.ABANDON: f"abandoning it (it would not commit in time) and stopping without a save of step {step}",
    }[choice]
    return {
        "choice": choice.value,
        "why": f"{'emergency checkpoint' if may_save else 'stop without a save'} with the background "
        f"save of step {in_flight_step} in flight ({figures}): {what}",
    }


def _seconds(value: float | None) -> str:
    return "unknown (nothing measured yet)" if value is None else f"{value:.1f} s"
