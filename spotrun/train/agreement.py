"""The per-step agreement of :meth:`~spotrun.train.checkpointer.Checkpointer.end_of_step`: one
all-reduce of a few flags per look, so that every rank decides the same at the same step.

``"immediate"`` waits for it at the look; ``"pipelined"`` starts it at the end of one look and reads
it at the next, so its latency (it grows with the rank count: ``docs/design/scale.md``) overlaps
the steps between. Every rank reads the same result at the same step either way, so the decisions
stay identical; a pipelined request is acted on one look later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spotrun.errors import CollectiveTimeoutError, ConfigError
from spotrun.tools import dist

#: The agreements ``Checkpointer(agreement=...)`` and ``$SPOTRUN_AGREEMENT`` accept.
AGREEMENTS = ("auto", "immediate", "pipelined")
#: ``"auto"`` pipelines from this many ranks: below it the all-reduce costs well under a
#: millisecond (``benchmarks/coordination_cost.py``) and a stop is acted on at the step it was seen.
PIPELINED_FROM_RANKS = 64


def check_agreement(agreement: str) -> str:
    if agreement not in AGREEMENTS:
        raise ConfigError(f"agreement must be one of {AGREEMENTS}, got {agreement!r}")
    return agreement


def pipelines(agreement: str, world_size: int) -> bool:
    """Whether ``agreement`` at ``world_size`` ranks is pipelined (never in one process: nothing to wait for)."""
    if world_size < 2:
        return False
    return agreement == "pipelined" or (agreement == "auto" and world_size >= PIPELINED_FROM_RANKS)


@dataclass(frozen=True)
class Flags:
    """One rank's flags at a look, and which background saves were in flight when it took them."""

    save_and_stop: bool
    stop_without_save: bool
    save_to_memory: bool
    checkpoint_requested: bool
    save_running: bool
    tier_running: bool
    save_in_flight: object = None  # the in-flight save objects (identity only)
    tier_in_flight: object = None


@dataclass(frozen=True)
class Agreed:
    """The flags any rank raised. ``save_running``/``tier_running``: ``None`` when a save started on
    this rank after the flags were taken (the agreement says nothing about it)."""

    save_and_stop: bool
    stop_without_save: bool
    save_to_memory: bool
    checkpoint_requested: bool
    save_running: bool | None
    tier_running: bool | None


class Agreement:
    """The looks of one Checkpointer, immediate or pipelined (see the module docstring)."""

    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self._pending: tuple[object, Flags] | None = None  # pipelined: started, not yet read

    def look(
        self,
        flags: Callable[[], Flags],
        save_in_flight: object,
        tier_in_flight: object,
        *,
        timeout_s: float,
        what: str,
    ) -> Agreed | None:
        """The agreed flags at this look (``None``: pipelined, nothing started yet); ``flags``: this
        rank's now (immediate only); ``save_in_flight``, ``tier_in_flight``: the background saves in
        flight now (to tell a save started since the flags were taken)."""
        if not self.pipelined:
            taken = flags()
            pending = self._start(taken, timeout_s=timeout_s, what=what)
        elif self._pending is None:
            return None
        else:
            (pending, taken), self._pending = self._pending, None
        raised = pending.wait()
        return Agreed(
            *raised[:4],
            save_running=raised[4] if taken.save_in_flight is save_in_flight else None,
            tier_running=raised[5] if taken.tier_in_flight is tier_in_flight else None,
        )

    def start_next(self, flags: Flags, *, timeout_s: float, what: str) -> None:
        """Pipelined: start the all-reduce the next look reads (after this step's saves started)."""
        if self.pipelined:
            self._pending = (self._start(flags, timeout_s=timeout_s, what=what), flags)

    def drop(self) -> None:
        """Wait for a started all-reduce and forget it (training stops, or the Checkpointer closes:
        no later look reads it). Its result is not needed, nor its failure: a rank that did not
        arrive broke the group, whose next collective says so. Waited for all the same: gloo's
        thread must be done with it before the process exits (see spotrun.tools.collectives)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[0].wait()
            except CollectiveTimeoutError:
                pass

    @staticmethod
    def _start(flags: Flags, *, timeout_s: float, what: str):
        values = [
            flags.save_and_stop,
            flags.stop_without_save,
            flags.save_to_memory,
            flags.checkpoint_requested,
            flags.save_running,
            flags.tier_running,
        ]
        return dist.start_any_rank_each(values, timeout_s=timeout_s, what=what)
