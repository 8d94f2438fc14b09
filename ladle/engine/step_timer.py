"""A step's time: its start on the engine's clock, the wall seconds of its phases, the clock advanced.

Phases: schedule, prepare (batches and metadata, inside the forwards), forward, sample, update. The
clock is advanced by the step's compute once its tokens exist (their time stamp), then by the update's
own time (detokenising, stop checks), which still counts toward the step.
"""

from __future__ import annotations

import time

import torch

from ladle.engine.clock import Clock


class StepTimer:
    def __init__(self, clock: Clock, device: torch.device) -> None:
        self.clock = clock
        self.cuda = device.type == "cuda"
        self.device = device
        self.start = clock.now()
        self.phases: dict[str, float] = {}
        self._t0 = self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The seconds since the last lap belong to `phase`."""
        t = time.perf_counter()
        self.phases[phase] = t - self._last
        self._last = t

    def forwards_done(self, prepare_time: float) -> None:
        """The forwards ran (synchronised on CUDA); prepare_time of their time was host preparation."""
        self._sync()
        t = time.perf_counter()
        self.phases["prepare"] = prepare_time
        self.phases["forward"] = t - self._last - prepare_time
        self._last = t

    def compute_done(self) -> float:
        """The clock advances by the step so far; returns its time now (the new tokens' time)."""
        self._sync()
        self.clock.step_finished(time.perf_counter() - self._t0)
        self._last = time.perf_counter()
        return self.clock.now()

    def update_done(self) -> None:
        self.lap("update")
        self.clock.step_finished(self.phases["update"])

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
