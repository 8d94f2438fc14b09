"""Arrival processes: when each request enters the engine, in seconds from the job's start.

Times are drawn in source order, one per row (rows skipped on resume and rows that error included),
so a row's arrival depends only on the seed and its position, never on what else happened.
"""

from __future__ import annotations

import numpy as np

from ladle.runner.config import ArrivalConfig


class ArrivalError(ValueError):
    """A row's trace arrival is missing or invalid (the row becomes an error row)."""


class Arrivals:
    """Stateful generator: `next(trace_value)` returns the arrival of the next row."""

    def __init__(self, cfg: ArrivalConfig, rate: float | None = None) -> None:
        """rate: requests per second when the config gives a `load` instead (resolved by calibration)."""
        self.cfg = cfg
        self.rate = cfg.rate if rate is None else rate
        self._rng = np.random.default_rng(cfg.seed)
        self._t = 0.0
        self._scale = 1e-3 if cfg.unit == "ms" else 1.0

    def gap(self) -> float:
        c = self.cfg
        if c.process == "poisson":
            return float(self._rng.exponential(1.0 / self.rate))
        if c.process == "gamma":
            # Gamma inter-arrival times with shape k = burstiness and mean 1/rate (vLLM's benchmark shape).
            k = c.burstiness
            return float(self._rng.gamma(k, 1.0 / (self.rate * k)))
        return 0.0

    def next(self, trace_value: object = None) -> float:
        c = self.cfg
        if c.process == "trace":
            if trace_value is None:
                raise ArrivalError(f"arrival column {c.column!r} is null")
            number = trace_number(trace_value)
            if number is None:
                raise ArrivalError(f"arrival column {c.column!r} holds {_short(trace_value)}, not a number")
            t = number * self._scale
            if not np.isfinite(t) or t < 0:
                raise ArrivalError(f"arrival column {c.column!r} holds {trace_value!r}: must be a finite time >= 0")
            return c.start + t
        if c.process in ("poisson", "gamma"):
            self._t += self.gap()
        return c.start + self._t


def trace_number(value: object) -> float | None:
    """A trace cell as a number (a number or its text), None when it is none (the row's error here; the
    trace-order check, runner/sources/columns.py, skips it)."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer too large for a float
        return None


def _short(value: object, most: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def arrival_times(cfg: ArrivalConfig, n: int, rate: float | None = None) -> np.ndarray:
    """`n` arrivals of a generated process (offline, poisson, gamma) at once."""
    a = Arrivals(cfg, rate)
    return np.array([a.next() for _ in range(n)], dtype=np.float64)


class ArrivalStreams:
    """One arrival process per request class (workload.class_arrivals), the workload's own for the
    other rows. A process given as a `load` is drawn at the rate the calibration gives for the mean
    prompt length of its rows in the first batch read that has any."""

    def __init__(self, default: ArrivalConfig, by_class: dict[str, ArrivalConfig], calibration=None) -> None:
        self.default, self.by_class, self.calibration = default, dict(by_class), calibration
        self._streams: dict[str | None, Arrivals] = {}
        self.rates: dict[str, float] = {}  # stream ("workload" or the class) -> resolved rate

    def key(self, klass: str | None) -> str | None:
        return klass if klass is not None and klass in self.by_class else None

    def config(self, key: str | None) -> ArrivalConfig:
        return self.default if key is None else self.by_class[key]

    def unresolved(self) -> set[str | None]:
        """Streams that still need prompt lengths to get their rate."""
        keys = [None, *self.by_class]
        return {k for k in keys if k not in self._streams and self.config(k).load is not None}

    def resolve(self, lengths: dict[str | None, list[int]]) -> None:
        for key in self.unresolved():
            seen = lengths.get(key)
            if seen:
                if self.calibration is None:
                    raise ValueError("an arrival `load` needs a calibration of the engine")
                rate = self.calibration.rate(self.config(key).load, sum(seen) / len(seen))
                self.rates["workload" if key is None else key] = rate
                self._streams[key] = Arrivals(self.config(key), rate)

    def next(self, klass: str | None, trace_value: object = None) -> float:
        key = self.key(klass)
        stream = self._streams.get(key)
        if stream is None:
            cfg = self.config(key)
            if cfg.load is not None:  # no length seen yet for this stream: cannot happen after resolve()
                raise ArrivalError(f"arrival rate for {key or 'the workload'} is not resolved")
            stream = self._streams[key] = Arrivals(cfg)
        return stream.next(trace_value)
