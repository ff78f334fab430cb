"""The roll call after a collective gave up (spotrun/tools/rollcall.py), on a store in memory with
the ranks as threads; issue 26, point 4. With real ranks and torch's store: test_bounded_collectives.py."""

from __future__ import annotations

import threading
import time

import pytest

from spotrun.tools import rollcall


class MemoryStore:
    """The three store requests the roll call makes, as torch's ``PrefixStore`` answers them."""

    def __init__(self) -> None:
        self._values: dict[str, object] = {}
        self._lock = threading.Lock()
        self.requests = 0

    def set(self, key: str, value: str) -> None:
        with self._lock:
            self.requests += 1
            self._values[key] = value

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self.requests += 1
            self._values[key] = int(self._values.get(key, 0)) + amount
            return int(self._values[key])

    def list_keys(self) -> list[str]:
        with self._lock:
            self.requests += 1
            return list(self._values)


def call_in_threads(store, ranks: list[int], world_size: int, window_s: float) -> dict[int, rollcall.RollCall]:
    calls: dict[int, rollcall.RollCall] = {}
    threads = [
        threading.Thread(target=lambda r=r: calls.__setitem__(r, rollcall.hold(store, r, world_size, window_s)))
        for r in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return calls


@pytest.mark.parametrize(("timeout_s", "window_s"), [(300.0, 5.0), (8.0, 2.0), (1.0, 0.5), (0.1, 0.5)])
def test_the_window_is_a_quarter_of_the_bound_between_half_a_second_and_5_s(timeout_s, window_s):
    assert rollcall.window_s(timeout_s) == window_s


def test_the_ranks_that_do_not_check_in_are_the_missing_ones():
    """Ranks 0, 2 and 3 of 4 check in; rank 1 never does: each of them finds rank 1 missing once
    the window has passed."""
    store = MemoryStore()
    started_s = time.monotonic()
    calls = call_in_threads(store, [0, 2, 3], 4, window_s=1.0)
    assert time.monotonic() - started_s >= 1.0, "they waited the window for rank 1"
    for call in calls.values():
        assert call.present == [0, 2, 3] and call.missing(4) == [1] and not call.completed


def test_the_roll_call_ends_as_soon_as_every_rank_checked_in():
    """Every rank gave up (all present): nobody waits for the 60 s window; nobody is missing."""
    store = MemoryStore()
    started_s = time.monotonic()
    calls = call_in_threads(store, [0, 1, 2], 3, window_s=60.0)
    assert time.monotonic() - started_s < 30.0
    assert all(call.missing(3) == [] for call in calls.values())


def test_a_collective_that_completes_during_the_roll_call_ends_it():
    """A rank was only late: the collective completed during the window, and the roll call says so."""
    finished = threading.Event()
    threading.Timer(0.3, finished.set).start()
    call = rollcall.hold(MemoryStore(), 0, 2, 60.0, finished.is_set)
    assert call.completed


def test_a_store_that_fails_gives_no_answer_and_raises_nothing():
    class Broken(MemoryStore):
        def add(self, key, amount):
            raise RuntimeError("connection reset by peer")

    call = rollcall.hold(Broken(), 0, 2, 0.5)
    assert call.present is None and call.missing(2) is None


def test_a_store_that_does_not_answer_cannot_hold_the_roll_call_past_its_bound():
    """A store whose host is itself stopped never answers; the roll call gives up after its window and
    the store's slack, saying it got no answer."""
    release = threading.Event()

    class Stuck(MemoryStore):
        def add(self, key, amount):
            release.wait()
            return super().add(key, amount)

    started_s = time.monotonic()
    try:
        call = rollcall.hold(Stuck(), 0, 2, 0.5)
    finally:
        release.set()  # the helper thread ends with the test
    assert call.present is None
    assert time.monotonic() - started_s < 0.5 + rollcall.STORE_SLACK_S + 10.0


def test_a_second_look_counts_no_rank_twice():
    """After gloo closed its connections a rank looks again without checking in again: the ranks
    that checked in meanwhile are seen, and the count is not raised by the second look."""
    store = MemoryStore()
    call_in_threads(store, [0, 2], 3, window_s=0.2)
    call = rollcall.hold(store, 0, 3, 0.2, check_in=False)
    assert call.missing(3) == [1]
    assert store.add("arrived", 0) == 2
