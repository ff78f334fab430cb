"""The roll call after a collective gave up: which ranks did not arrive.

A gloo collective that times out says only that it timed out. Each rank that gave up then
checks in on the job's key-value store (torchrun's, hosted by its agent, so a stopped worker
does not take it down): it sets its own key under the collective's prefix and counts itself,
then waits up to a window for the others. The ranks without a key when the window ends (or once
every rank checked in) are the ones that did not arrive. Nothing is written on the happy path;
on a failure each rank makes O(1) store requests per poll and one listing at the end.

A rank stopped before or inside the collective is always named. A rank that got through the
collective just before a peer stopped mid-way (a race of microseconds) and went on may be named
too. The store is only asked from a helper thread joined with a bound: a store whose host is
itself stopped cannot hold the caller. The protocol and its timeouts: ``docs/reference/timeouts.md``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The roll call's longest window, in seconds; a quarter of the collective's bound when that is less.
WINDOW_S = 5.0
#: The shortest window, in seconds: ranks that gave up together check in within milliseconds.
MIN_WINDOW_S = 0.5
#: How often a rank at the roll call looks at the count of ranks checked in, in seconds.
POLL_S = 0.1
#: How long past the window the store may take to answer before the roll call is given up.
STORE_SLACK_S = 5.0
#: After a collective's own timeout closed a rank's connections, how long that rank still waits
#: for the ranks that were blocked on it (they fail at once and check in), in seconds.
AFTER_CLOSE_S = 1.0
#: The count of ranks checked in, next to their keys.
_COUNT_KEY = "arrived"


def window_s(timeout_s: float) -> float:
    """The roll call's window after a collective bounded by ``timeout_s`` seconds (:data:`WINDOW_S`,
    or a quarter of the bound when that is less, at least :data:`MIN_WINDOW_S`)."""
    return min(WINDOW_S, max(MIN_WINDOW_S, timeout_s / 4))


@dataclass(frozen=True)
class RollCall:
    """What the roll call found.

    Attributes:
        present: the ranks that checked in (this one included), sorted; ``None`` when the store
            did not answer in time.
        completed: the collective completed during the roll call (a rank was late, not gone).
    """

    present: list[int] | None
    completed: bool = False

    def missing(self, world_size: int) -> list[int] | None:
        """The ranks that did not check in; ``None`` when the store did not answer."""
        if self.present is None:
            return None
        return sorted(set(range(world_size)) - set(self.present))


def hold(
    store: Any,
    rank: int,
    world_size: int,
    window: float,
    completed: Callable[[], bool] = lambda: False,
    *,
    check_in: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> RollCall:
    """Check in on ``store`` (a store scoped to one collective: a ``torch.distributed.PrefixStore``)
    and wait up to ``window`` seconds for the other ranks; returns early when every rank
    checked in or ``completed()`` (the collective ended after all). ``check_in`` false: this rank
    checked in already (a second look). Never raises for the store: a store that fails or does
    not answer within the window and :data:`STORE_SLACK_S` gives ``present=None``."""
    found: dict[str, Any] = {}

    def call() -> None:
        try:
            if check_in:
                store.set(str(rank), "")
            arrived = store.add(_COUNT_KEY, 1 if check_in else 0)
            end_s = clock() + window
            while arrived < world_size and clock() < end_s and not completed():
                time.sleep(POLL_S)
                arrived = store.add(_COUNT_KEY, 0)
            found["present"] = sorted(int(key) for key in store.list_keys() if key.isdigit())
        except Exception as exc:  # noqa: BLE001 - the roll call only explains a failure already certain
            found["error"] = exc

    helper = threading.Thread(target=call, name="spotrun-rollcall", daemon=True)
    helper.start()
    helper.join(window + STORE_SLACK_S)
    return RollCall(present=found.get("present"), completed=completed())
