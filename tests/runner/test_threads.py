"""The CPU thread count is decided deliberately and recorded."""

from __future__ import annotations

import json

import pytest
import torch

from runner.config import ConfigError, check, to_job_config
from runner.job import run_job
from runner.threads import default_threads
from tests.runner.conftest import compose_cfg


@pytest.mark.parametrize("cores,load,expected", [(2, 0.1, 2), (2, 1.2, 1), (2, 5.0, 1), (16, 3.4, 13), (1, 0, 1)])
def test_default_is_the_free_cores(cores, load, expected):
    assert default_threads(cores, load) == expected


def test_threads_are_applied_and_reported(tmp_path):
    before = torch.get_num_threads()
    try:
        run_job(compose_cfg("threads=1", "workload.limit=2"), tmp_path / "r")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["cpu_threads"]["threads"] == 1 and summary["cpu_threads"]["rule"] == "threads (set)"


def test_threads_must_be_positive():
    with pytest.raises(ConfigError, match="threads=0"):
        check(to_job_config(compose_cfg("threads=0")))
