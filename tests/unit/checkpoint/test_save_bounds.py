"""How long a save's collectives wait, derived from the save's deadline (spotrun/checkpoint/save_bounds.py;
the table: docs/reference/timeouts.md); issue 26, point 4."""

from __future__ import annotations

import time

import pytest

from spotrun.checkpoint.save_bounds import (
    MIN_PHASE_TIMEOUT_S,
    SAVE_SETTLE_S,
    before_deadline_s,
    collectives_deadline_s,
    phase_timeout_s,
)
from spotrun.control.hangs import LOOK_INTERVAL_S
from spotrun.tools import rollcall


@pytest.mark.parametrize(("timeout_s", "waits_s"), [(300.0, 370.0), (8.0, 16.0), (2.0, 4.0)])
def test_a_periodic_save_waits_past_its_storage_deadline_by_the_settle_margin(timeout_s, waits_s):
    """A rank whose last request overran the storage deadline still reports: min(T, 70 s) more."""
    now_s = time.monotonic()
    assert collectives_deadline_s(timeout_s) - now_s == pytest.approx(waits_s, abs=0.5)
    assert waits_s == timeout_s + min(timeout_s, SAVE_SETTLE_S)


@pytest.mark.parametrize("left_s", [25.0, 15.0, 8.0])
def test_a_collective_facing_a_stops_deadline_names_the_rank_before_it(left_s):
    """The agreement on a stop: its bound, the roll call's window, the second look once gloo closed
    the connections, and the supervisor's look for the report all fit before the deadline."""
    spent_s = before_deadline_s(left_s) + rollcall.window_s(left_s) + rollcall.AFTER_CLOSE_S + LOOK_INTERVAL_S
    assert spent_s == pytest.approx(left_s)


@pytest.mark.parametrize("left_s", [0.0, -3.0, 1.0])
def test_a_deadline_too_close_still_leaves_each_collective_its_shortest_wait(left_s):
    assert before_deadline_s(left_s) == MIN_PHASE_TIMEOUT_S
    assert phase_timeout_s(time.monotonic() + left_s) >= MIN_PHASE_TIMEOUT_S
