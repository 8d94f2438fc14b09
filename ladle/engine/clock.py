"""Where the engine reads time. Wall time for live use; virtual time for replaying arrivals.

A VirtualClock advances only by what the engine reports (each step's measured duration) and by
explicit jumps over idle gaps, so a sparse arrival trace costs no waiting while every latency is
still real compute time.
"""

from __future__ import annotations

import time


class Clock:
    virtual: bool = False

    def now(self) -> float:
        raise NotImplementedError

    def step_finished(self, measured_seconds: float) -> None:
        """Called after each engine step with its measured wall duration."""

    def advance_to(self, t: float) -> None:
        """Jump over an idle gap (virtual clocks); wall clocks wait."""


class WallClock(Clock):
    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def advance_to(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock(Clock):
    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def step_finished(self, measured_seconds: float) -> None:
        self._now += measured_seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
