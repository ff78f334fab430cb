"""What the Checkpointer does at a step boundary, decided from plain facts: no I/O, no collectives.

:func:`decide` answers "save, stop, or go on?" from a :class:`StepContext` that
:meth:`spotrun.Checkpointer.end_of_step` fills in after its all-reduce, so every rank decides
the same; :func:`emergency_timeout_s` bounds an emergency save. How to save lives elsewhere
(:mod:`spotrun.checkpoint.save`, :mod:`spotrun.checkpoint.background`), and so does what
becomes of a background save in flight when the job stops (:mod:`spotrun.checkpoint.in_flight`).
Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(str, enum.Enum):
    """What the Checkpointer does at a step boundary."""

    CONTINUE = "continue"  # nothing to save at this step
    SAVE = "save"  # a due save (periodic, or a checkpoint the supervisor asked for); training goes on
    SAVE_AND_STOP = "save-and-stop"  # the emergency checkpoint of this step, then stop
    SAVE_TO_MEMORY_AND_STOP = "save-to-memory-and-stop"  # the emergency checkpoint in the fast tier, then stop
    STOP_WITHOUT_SAVE = "stop-without-save"  # stop now; the newest complete checkpoint stays the resume point


@dataclass(frozen=True)
class StepContext:
    """The facts of one step boundary, the same on every rank.

    Attributes:
        step: the step just finished.
        interval_steps: a periodic save every this many steps; 0 = none.
        stop_at_step: ``$SPOTRUN_STOP_AT_STEP`` (stop with an emergency checkpoint at or
            past it); ``None`` when unset.
        save_and_stop: some rank was asked to save and stop (its supervisor's request, a
            signal, or a supervisor that is gone). The three request flags are agreed by
            all ranks and False at a step that looks for no requests.
        stop_without_save: some rank's supervisor asked to stop without a save (it found no
            time to commit one before the deadline).
        checkpoint_requested: some rank's supervisor asked for an ordinary checkpoint.
        save_to_memory: some rank's supervisor asked for the emergency checkpoint in the fast
            tier (copied to another node), a save to storage not fitting before its deadline.
    """

    step: int
    interval_steps: int = 0
    stop_at_step: int | None = None
    save_and_stop: bool = False
    stop_without_save: bool = False
    checkpoint_requested: bool = False
    save_to_memory: bool = False


@dataclass(frozen=True)
class Decision:
    """The answer of :func:`decide`.

    Attributes:
        action: what to do.
        reason: of a :attr:`Action.SAVE`, recorded in the manifest: ``"periodic"`` or
            ``"requested"``.
        why: who asked for a :attr:`Action.SAVE_AND_STOP` when no rank's request says it
            (``"SPOTRUN_STOP_AT_STEP=N"``), for the log.
    """

    action: Action
    reason: str | None = None
    why: str | None = None

    @property
    def stops(self) -> bool:
        """Whether the training loop stops at this step."""
        return self.action in (Action.SAVE_AND_STOP, Action.SAVE_TO_MEMORY_AND_STOP, Action.STOP_WITHOUT_SAVE)


def decide(ctx: StepContext) -> Decision:
    """What to do at ``ctx.step``, in this order: a stop without a save (one node's
    supervisor found no time, so nobody saves), an emergency save to the fast tier (one node's
    supervisor found time for that only), to storage, ``$SPOTRUN_STOP_AT_STEP``, a requested
    checkpoint, a periodic save."""
    if ctx.stop_without_save:
        return Decision(Action.STOP_WITHOUT_SAVE)
    if ctx.save_to_memory:
        return Decision(Action.SAVE_TO_MEMORY_AND_STOP)
    if ctx.save_and_stop:
        return Decision(Action.SAVE_AND_STOP)
    if ctx.stop_at_step is not None and ctx.step >= ctx.stop_at_step:
        return Decision(Action.SAVE_AND_STOP, why=f"SPOTRUN_STOP_AT_STEP={ctx.stop_at_step}")
    if ctx.checkpoint_requested:
        return Decision(Action.SAVE, reason="requested")
    if ctx.interval_steps and ctx.step % ctx.interval_steps == 0:
        return Decision(Action.SAVE, reason="periodic")
    return Decision(Action.CONTINUE)


def emergency_timeout_s(
    save_timeout_s: float,
    now_unix_s: float,
    *,
    deadline_unix_s: float | None = None,
    kill_unix_s: float | None = None,
    safety_margin_s: float = 0.0,
) -> float:
    """Seconds an emergency save may take: ``save_timeout_s``, or less when the supervisor's
    request names an earlier ``deadline_unix_s``, or when this process is killed at
    ``kill_unix_s`` (its supervisor is gone; the save must end ``safety_margin_s`` before).
    Zero or less: no time left. Times are seconds since the epoch."""
    timeout_s = save_timeout_s
    if deadline_unix_s is not None:
        timeout_s = min(timeout_s, deadline_unix_s - now_unix_s)
    if kill_unix_s is not None:
        timeout_s = min(timeout_s, kill_unix_s - safety_margin_s - now_unix_s)
    return timeout_s
