"""Arrival processes: when each request enters the engine, in seconds from the job's start.

Times are drawn in source order, one per row (rows skipped on resume and rows that error included),
so a row's arrival depends only on the seed and its position, never on what else happened.
"""

from __future__ import annotations

import numpy as np

from runner.config import ArrivalConfig


class ArrivalError(ValueError):
    """A row's trace arrival is missing or invalid (the row becomes an error row)."""


class Arrivals:
    """Stateful generator: `next(trace_value)` returns the arrival of the next row."""

    def __init__(self, cfg: ArrivalConfig) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)
        self._t = 0.0
        self._scale = 1e-3 if cfg.unit == "ms" else 1.0

    def gap(self) -> float:
        c = self.cfg
        if c.process == "poisson":
            return float(self._rng.exponential(1.0 / c.rate))
        if c.process == "gamma":
            # Gamma inter-arrival times with shape k = burstiness and mean 1/rate (vLLM's benchmark shape).
            k = c.burstiness
            return float(self._rng.gamma(k, 1.0 / (c.rate * k)))
        return 0.0

    def next(self, trace_value: object = None) -> float:
        c = self.cfg
        if c.process == "trace":
            if trace_value is None:
                raise ArrivalError(f"arrival column {c.column!r} is null")
            try:
                t = float(trace_value) * self._scale
            except (TypeError, ValueError):
                raise ArrivalError(f"arrival column {c.column!r} holds {trace_value!r}, not a number") from None
            if not np.isfinite(t) or t < 0:
                raise ArrivalError(f"arrival column {c.column!r} holds {trace_value!r}: must be a finite time >= 0")
            return c.start + t
        if c.process in ("poisson", "gamma"):
            self._t += self.gap()
        return c.start + self._t


def arrival_times(cfg: ArrivalConfig, n: int) -> np.ndarray:
    """`n` arrivals of a generated process (offline, poisson, gamma) at once."""
    a = Arrivals(cfg)
    return np.array([a.next() for _ in range(n)], dtype=np.float64)
