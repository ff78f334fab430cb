"""A checkpoint interval suggested from a run's own figures (Young/Daly), and the goodput it
would have given: pure computation on a :class:`spotrun.eventlog.goodput.Accounting`.

The classic trade-off: saving more often costs more save time, saving less often loses more
work when a failure hits. With ``C`` the cost of one checkpoint and ``M`` the mean time
between failures, the interval of computation between checkpoints that minimises the waste is

* Young (J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9):530-531, 1974): ``tau = sqrt(2 C M)``;
* Daly (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", Future Generation Computer Systems 22(3):303-312, 2006, eq. 37):
  ``tau = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``, else
  ``tau = M``. This is the suggestion.

How the run's figures fill them in:

* ``C`` is the mean **stall** of the committed periodic saves - the training time each
  checkpoint costs. For a background save that is the staging copy (and any wait for the
  save before it), not the whole save: the write runs while training goes on. (A synchronous
  save's stall is its whole duration.)
* ``M`` is wall time / the interruptions whose **stop was not saved** (killed without
  notice, a failed command, an emergency save that did not commit). A preemption whose
  emergency checkpoint committed loses no step whatever the interval, so it does not count
  as a failure here (it costs its restart either way). At least
  :data:`MIN_UNSAVED_INTERRUPTIONS` are needed: with fewer there is no rate to estimate, and
  no suggestion is made. With ``n`` failures the rate's relative standard error is about
  ``1 / sqrt(n)``, and ``tau``'s about half that; near its optimum the waste is flat (an
  interval off by a factor ``x`` wastes ``(x + 1/x) / 2`` times the least), so a rough
  rate still gives a useful interval.
* A background save cannot start while the one before is in flight, so the suggestion is at
  least the mean save **duration** ``D``; a failure also loses the ``D - C`` by which the
  newest committed checkpoint lags the staged step.

The goodput a given interval ``tau`` would have given on this run (the model): the same wall
time ``W``, the same useful and lost time, except that the observed save stalls and lost
time are replaced by the model's for ``tau``::

    goodput(tau) = (useful + stalls + lost - (T / tau) C - n (tau / 2 + D - C)) / W

with ``T`` the training time (save stalls excluded), ``n`` the unsaved interruptions, each
losing on average half an interval plus the lag (failures uniform in time). Clipped to
[0, 1]. The report shows it for the current interval as well, next to the observed goodput:
their difference is what the model does not capture (how far from half an interval the
actual losses fell).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotrun.eventlog.goodput import Accounting

#: Least unsaved interruptions from which a failure rate, hence an interval, is estimated.
MIN_UNSAVED_INTERRUPTIONS = 2
_PER_HOUR = 3600.0


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's interval ``sqrt(2 C M)``, in seconds (``cost_s`` = C, ``mtbf_s`` = M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval in seconds (see the module docstring); ``M`` when
    ``C >= 2M``."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return young_interval_s(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


@dataclass(frozen=True)
class Advice:
    """The suggestion and its inputs (seconds, steps; goodput 0..1).

    ``interval_steps`` is ``None`` when no suggestion is made; ``reason`` then says why.
    """

    reason: str | None
    interruptions: int
    unsaved_interruptions: int
    interruptions_per_hour: float | None
    unsaved_per_hour: float | None
    save_stall_s: float | None
    save_duration_s: float | None
    step_time_s: float | None
    mtbf_s: float | None
    young_interval_s: float | None
    daly_interval_s: float | None
    interval_s: float | None
    interval_steps: int | None
    current_interval_steps: int | None
    goodput_observed: float | None
    goodput_model_current: float | None
    goodput_model_suggested: float | None


def modelled_goodput(accounting: Accounting, interval_s: float, cost_s: float, lag_s: float) -> float | None:
    """``goodput(tau)`` of the module docstring for ``interval_s`` = tau (seconds of
    training between checkpoints), ``cost_s`` = C and ``lag_s`` = D - C; ``None`` without
    wall time."""
    totals = accounting.totals
    if totals.wall_s <= 0 or interval_s <= 0:
        return None
    saving_s = totals.training_s / interval_s * cost_s
    losing_s = totals.unsaved_interruptions * (interval_s / 2.0 + lag_s)
    useful_s = totals.useful_s + totals.save_stall_s + totals.lost_s - saving_s - losing_s
    return min(1.0, max(0.0, useful_s / totals.wall_s))


def advise(accounting: Accounting) -> Advice:
    """Suggest a checkpoint interval for this run (see the module docstring)."""
    totals = accounting.totals
    hours = totals.wall_s / _PER_HOUR
    saves = accounting.saves
    stall_s = sum(float(r.get("stall_s") or 0.0) for r in saves) / len(saves) if saves else None
    duration_s = sum(float(r.get("duration_s") or 0.0) for r in saves) / len(saves) if saves else None
    trained = sum(row.steps_trained for row in accounting.incarnations if row.step_time_s is not None)
    timed_s = sum(row.training_s for row in accounting.incarnations if row.step_time_s is not None)
    step_time_s = timed_s / trained if trained else None
    numbered = [row for row in accounting.incarnations if row.number is not None]
    current = numbered[-1].interval_steps if numbered else None
    n = totals.unsaved_interruptions
    base = dict(
        interruptions=totals.interruptions,
        unsaved_interruptions=n,
        interruptions_per_hour=totals.interruptions / hours if hours > 0 else None,
        unsaved_per_hour=n / hours if hours > 0 else None,
        save_stall_s=stall_s,
        save_duration_s=duration_s,
        step_time_s=step_time_s,
        current_interval_steps=current,
        goodput_observed=totals.goodput,
    )
    reason = None
    if n < MIN_UNSAVED_INTERRUPTIONS:
        reason = (
            f"too few interruptions that lost work to estimate their rate: {n} (killed without notice, "
            f"failed, or an emergency save that did not commit; at least {MIN_UNSAVED_INTERRUPTIONS} needed)"
        )
    elif stall_s is None:
        reason = "no committed periodic save to measure a save's cost from"
    elif step_time_s is None:
        reason = "no training steps timed"
    if reason is not None:
        return Advice(
            reason=reason,
            mtbf_s=totals.wall_s / n if n else None,
            young_interval_s=None,
            daly_interval_s=None,
            interval_s=None,
            interval_steps=None,
            goodput_model_current=None,
            goodput_model_suggested=None,
            **base,
        )
    mtbf_s = totals.wall_s / n
    cost_s = max(stall_s, 1e-9)
    lag_s = max(0.0, duration_s - stall_s)
    young_s, daly_s = young_interval_s(cost_s, mtbf_s), daly_interval_s(cost_s, mtbf_s)
    interval_s = max(daly_s, duration_s)
    interval_steps = max(1, round(interval_s / step_time_s))
    return Advice(
        reason=None,
        mtbf_s=mtbf_s,
        young_interval_s=young_s,
        daly_interval_s=daly_s,
        interval_s=interval_steps * step_time_s,
        interval_steps=interval_steps,
        goodput_model_current=modelled_goodput(accounting, current * step_time_s, cost_s, lag_s) if current else None,
        goodput_model_suggested=modelled_goodput(accounting, interval_steps * step_time_s, cost_s, lag_s),
        **base,
    )
