"""How long a save's collectives wait for every rank, derived from the save's storage deadline.

A save's storage operations are bounded by its timeout (``save_timeout_s``, or an emergency
save's time to the deadline). Its three collectives (:mod:`spotrun.checkpoint.save`) wait a
little longer than that for a rank whose last storage request overran the deadline, so that its
failure is reported as a failed save, not as a rank that did not arrive. The collectives that
face a stop's deadline before the save (the agreement on the stop, the decision on a save in
flight) give up early enough for the ranks that did not arrive to be named before it
(:func:`before_deadline_s`). The table of every bound and their order: ``docs/reference/timeouts.md``.
"""

from __future__ import annotations

import time

from spotrun.control.hangs import LOOK_INTERVAL_S
from spotrun.tools import rollcall

#: How much longer than its storage deadline a save's collectives wait (at most the save's own
#: timeout), in seconds: a storage request in flight at the deadline may end up to one request's
#: time later (S3, GCS, Azure: 10 s to connect, 60 s to read), and its rank must still report.
SAVE_SETTLE_S = 70.0
#: A phase's collective waits at least this long, in seconds, even once the deadline passed.
MIN_PHASE_TIMEOUT_S = 1.0


def collectives_deadline_s(timeout_s: float) -> float:
    """When (``time.monotonic()``) the collectives of a save starting now, whose storage
    operations are bounded by ``timeout_s`` seconds, give up: :data:`SAVE_SETTLE_S` after the
    storage deadline, or ``timeout_s`` after it when that is less. An emergency save's too: a
    rank whose storage was still retrying at the deadline reports its failure, not its absence
    (the supervisor stops the job at its deadline either way)."""
    return time.monotonic() + timeout_s + min(timeout_s, SAVE_SETTLE_S)


def before_deadline_s(left_s: float) -> float:
    """The bound of a collective that must name the ranks that did not arrive before a deadline
    ``left_s`` seconds away (a stop's): the roll call (its window, and its second look once gloo
    closed the connections) and the supervisor's look for the report
    (:data:`~spotrun.control.hangs.LOOK_INTERVAL_S`) still fit before it."""
    left_s = max(left_s, 0.0)
    spent_s = rollcall.window_s(left_s) + rollcall.AFTER_CLOSE_S + LOOK_INTERVAL_S
    return max(MIN_PHASE_TIMEOUT_S, left_s - spent_s)


def phase_timeout_s(until_s: float) -> float:
    """The bound of a phase's collective starting now, for collectives giving up at ``until_s``."""
    return max(MIN_PHASE_TIMEOUT_S, until_s - time.monotonic())
