"""Time as the search sees it: a wall clock and a sleep, injectable so tests run hours of
budget and lease expiry in no time (`FakeClock` advances when slept on)."""

from __future__ import annotations

import time


class Clock:
    """The real wall clock (seconds since the epoch: shared by workers on several nodes)."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class FakeClock(Clock):
    """A clock that only moves when slept on (or `advance`d)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def advance(self, seconds: float) -> None:
        self.t += seconds
