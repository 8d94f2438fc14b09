from __future__ import annotations

import numpy as np
import pytest

from ladle.runner.arrivals import ArrivalError, Arrivals, arrival_times
from ladle.runner.config import ArrivalConfig


def test_offline_all_at_start():
    assert arrival_times(ArrivalConfig(), 5).tolist() == [0.0] * 5
    assert arrival_times(ArrivalConfig(start=2.0), 2).tolist() == [2.0, 2.0]


def test_poisson_rate_and_seed():
    t = arrival_times(ArrivalConfig(process="poisson", rate=10.0, seed=3), 20000)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps >= 0) and np.all(np.diff(t) >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    np.testing.assert_array_equal(t, arrival_times(ArrivalConfig(process="poisson", rate=10.0, seed=3), 20000))
    assert not np.array_equal(t[:10], arrival_times(ArrivalConfig(process="poisson", rate=10.0, seed=4), 10))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness(burstiness):
    t = arrival_times(ArrivalConfig(process="gamma", rate=5.0, burstiness=burstiness, seed=1), 20000)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    # Gamma with shape k: coefficient of variation 1/sqrt(k) (burstier below 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)


def test_trace_units_and_errors():
    a = Arrivals(ArrivalConfig(process="trace", unit="ms", start=1.0))
    assert a.next(250) == pytest.approx(1.25)
    assert a.next(0) == 1.0  # a trace need not be sorted
    for bad in (None, "soon", -1, float("nan"), 10**400):  # 10**400: float() overflows (crashed the job)
        with pytest.raises(ArrivalError):
            a.next(bad)
    assert Arrivals(ArrivalConfig(process="trace")).next("2.5") == 2.5
