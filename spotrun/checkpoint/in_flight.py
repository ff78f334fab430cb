"""What to do with a background save in flight when the job must stop before a deadline.

Two places decide it with the same rule (:func:`choose`): the supervisor when a notice
arrives (whether to ask for an emergency save at all, :mod:`spotrun.supervisor.estimate`),
and the workers at the step boundary where they stop (:func:`settle`: rank 0 decides from
every rank's progress and broadcasts, so every rank does the same). In order of preference:

1. finish the save in flight, then also save the current step, when both fit before the deadline;
2. else finish the save in flight if it fits (the current step is not saved);
3. else abandon it (every rank sets its abort event: nothing commits, unless rank 0 had
   already committed) and save the current step, if that fits;
4. else finish the save in flight anyway (its step may still commit; the current one is lost).

When the workers are told to stop *without* saving (the supervisor found no time for a save),
the save in flight is finished if it fits, else abandoned so that they stop at once.
Figures that are unknown (nothing measured yet) count as fitting, as the supervisor's do.
"""

from __future__ import annotations

import enum
import logging
import time

from spotrun import dist
from spotrun.checkpoint.background import BackgroundSaver, InFlightSave

log = logging.getLogger(__name__)


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


def choose(in_flight_s: float | None, save_s: float | None, left_s: float, *,
           boundary_s: float = 0.0, may_save: bool = True) -> Choice:
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


def settle(saver: BackgroundSaver, *, step: int, left_s: float, full_save_s: float | None,
           may_save: bool) -> tuple[Choice, InFlightSave | None]:
    """Decide on rank 0, from every rank's progress, what happens to the save in flight; do it
    on every rank (abandon it or not, then wait for it to end); log the decision when a save
    was still being written.

    Collective on the training process group (one gather, one broadcast): every rank calls
    it at the same step, a save in flight or not.

    Args:
        saver: holds the save in flight.
        step: the current step (the one an emergency save would save).
        left_s: seconds left before the deadline.
        full_save_s: seconds a full save takes, as measured by this launch (rank 0's figure
            is used); ``None`` when nothing was measured.
        may_save: whether the current step may be saved (False: stopping without a save).

    Returns:
        The choice (the same on every rank) and the save that was in flight on this rank,
        ended (its outcome not yet acted on; none is in flight afterwards), or ``None``.
    """
    current = saver.in_flight
    running = saver.running
    mine = {"step": None if current is None else current.step, "running": running,
            "remaining_s": current.progress.remaining_s() if running else 0.0,
            "elapsed_s": 0.0 if current is None else time.monotonic() - current.started_s}
    everyone = dist.all_gather_json(mine)
    decision = None
    if dist.rank() == 0:
        decision = _decide(everyone, step, left_s, full_save_s, may_save)
    decision = dist.broadcast_json(decision)
    choice = Choice(decision["choice"])
    if choice.abandons:
        saver.abort()  # before the log line: whoever reads the log sees it already set
    if dist.rank() == 0 and decision["why"]:
        log.warning("%s", decision["why"])
    return choice, saver.take()


def _decide(everyone: list[dict], step: int, left_s: float, full_save_s: float | None, may_save: bool) -> dict:
    """Rank 0: the choice and the log line (``None``: nothing to say), from every rank's
    ``{"step", "running", "remaining_s", "elapsed_s"}``."""
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
    figures = (f"{_seconds(in_flight_s)} to finish it (slowest rank), {_seconds(full_save_s)} for a full save, "
               f"{left_s:.1f} s left before the deadline")
    what = {
        Choice.FINISH_THEN_SAVE: f"finishing it, then saving step {step}",
        Choice.FINISH_ONLY: (f"finishing it; step {step} is NOT saved (finishing it and then saving would not "
                             f"fit): step {in_flight_step} is the resume point if it commits") if may_save
        else f"finishing it, then stopping without a save of step {step}",
        Choice.ABANDON_AND_SAVE: f"abandoning it (it would not commit in time) and saving step {step} instead",
        Choice.FINISH_ANYWAY: f"neither fits; finishing it anyway: step {step} is NOT saved",
        Choice.ABANDON: f"abandoning it (it would not commit in time) and stopping without a save of step {step}",
    }[choice]
    return {"choice": choice.value,
            "why": f"{'emergency checkpoint' if may_save else 'stop without a save'} with the background "
                   f"save of step {in_flight_step} in flight ({figures}): {what}"}


def _seconds(value: float | None) -> str:
    return "unknown (nothing measured yet)" if value is None else f"{value:.1f} s"
