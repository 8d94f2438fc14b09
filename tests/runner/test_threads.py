"""The CPU thread count is decided deliberately and recorded."""

from __future__ import annotations

import json

import pytest
import torch

from ladle.runner.config import ConfigError, check, to_job_config
from ladle.runner.job import run_job
from ladle.runner.threads import default_threads
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


def _cgroup(tmp_path, v2: str | None = None, v1: tuple[int, int] | None = None, own: str = "/"):
    """A fake /sys/fs/cgroup (v2 cpu.max or v1 cfs quota/period) and /proc/self/cgroup naming `own`."""
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_self_cgroup"
    if v2 is not None:
        d = root / own.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(v2 + "\n")
        proc.write_text(f"0::{own}\n")
    else:
        d = root / "cpu"
        d.mkdir(parents=True)
        if v1 is not None:
            (d / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
            (d / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
        proc.write_text("4:cpu,cpuacct:/\n")
    return root, proc


@pytest.mark.parametrize(
    "v2,v1,own,expected",
    [
        ("200000 100000", None, "/", 2),  # docker --cpus=2
        ("150000 100000", None, "/job.slice/x.scope", 2),  # 1.5 CPUs: two threads, one half idle
        ("50000 100000", None, "/", 1),
        ("max 100000", None, "/", None),  # no quota
        (None, (300000, 100000), "/", 3),  # cgroup v1
        (None, (-1, 100000), "/", None),
        (None, None, "/", None),  # no cpu controller files at all
    ],
)
def test_cgroup_cpu_quota_is_read(tmp_path, v2, v1, own, expected):
    from ladle.runner.threads import cgroup_cpu_limit

    root, proc = _cgroup(tmp_path, v2, v1, own)
    assert cgroup_cpu_limit(root, proc) == expected


def test_a_cpu_quota_bounds_the_default(tmp_path, monkeypatch):
    """A container limited to 2 CPUs on a 64-core host: torch must not get 64 threads (they would be
    throttled by the quota at every op, the collapse the default exists to avoid)."""
    from ladle.runner import threads

    root, proc = _cgroup(tmp_path, "200000 100000")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(threads, "CGROUP_ROOT", root)
    monkeypatch.setattr(threads, "PROC_SELF_CGROUP", proc)
    assert threads.available_cores() == 2
    assert threads.default_threads(load=0.0) == 2


def test_more_threads_than_cores_is_warned(caplog):
    from ladle.runner.threads import apply_threads, available_cores

    before = torch.get_num_threads()
    try:
        with caplog.at_level("WARNING", logger="ladle.runner.threads"):
            recorded = apply_threads(available_cores() + 1)
    finally:
        torch.set_num_threads(before)
    assert recorded["threads"] == available_cores() + 1
    assert "more than the" in caplog.text and f"threads={available_cores() + 1}" in caplog.text
