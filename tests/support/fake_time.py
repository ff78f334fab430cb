"""A clock that only moves when ``sleep`` is called, for retry policies under test (no real waits)."""

from __future__ import annotations


class FakeTime:
    """A clock that only moves when ``sleep`` is called; records every sleep."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.sleeps_s: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps_s.append(seconds)
        self.now_s += seconds

    def clock(self) -> float:
        return self.now_s
