"""How many CPU threads torch may use: decided once per job, deliberately, and reported.

torch's default is one thread per physical core. When another process is busy on one of those cores,
its OpenMP threads wait for each other at every op and a step can take 25x longer (measured here: a
tiny-model step at 720 ms with the default vs 28 ms with one thread, on 2 cores with one busy). So the
default counts the cores that are actually free: the cores this process may run on, less the load
already on the machine (the 1-minute load average, rounded), at least one. `threads=N` sets it.
The cores this process may run on are its CPU affinity, bounded by its cgroup's CPU quota: a container
started with `--cpus=2` on a 64-core host sees 64 cores, and 64 threads sharing 2 CPUs of quota are
throttled at every op the same way.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from ladle.runner.startup import runtime_info

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path | None = None, proc_cgroup: Path | None = None) -> int | None:
    """CPUs this process's cgroup quota allows, ceil(quota / period); None when there is no quota
    (or no cgroup files to read). cgroup v2: `cpu.max` of the process's own group, else of the root
    (a container's namespaced view); v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    root = CGROUP_ROOT if root is None else root
    proc_cgroup = PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup
    own = next((line[3:] for line in (_read(proc_cgroup) or "").splitlines() if line.startswith("0::")), None)
    for cpu_max in ([root / own.lstrip("/") / "cpu.max"] if own else []) + [root / "cpu.max"]:
        text = _read(cpu_max)
        if text is not None:
            quota, _, period = text.partition(" ")
            if quota == "max" or not period:
                return None
            return max(1, math.ceil(int(quota) / int(period)))
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return None if int(quota) <= 0 else max(1, math.ceil(int(quota) / int(period)))
    return None


def available_cores() -> int:
    """The cores this process may run on (its affinity), at most what its cgroup's CPU quota allows."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        limit = cgroup_cpu_limit()
    except ValueError:  # a cgroup file in an unexpected format: go by the affinity
        limit = None
    return cores if limit is None else min(cores, limit)


def default_threads(cores: int | None = None, load: float | None = None) -> int:
    """Cores free for this job: available cores less the machine's current load, at least 1."""
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return max(1, min(cores, cores - round(load)))


_decided: int | None = None  # the default, decided once per process: a multirun's later jobs would
# otherwise count the earlier jobs' own load and run with fewer threads than the first


def apply_threads(requested: int | None) -> dict[str, object]:
    """Set torch's intra-op threads; returns what summary.json records."""
    import torch

    global _decided
    cores = available_cores()
    if requested is None and _decided is None:
        _decided = default_threads(cores)
    n = requested if requested is not None else _decided
    if n > cores:
        log.warning("threads=%d is more than the %d cores this process may use: threads will wait for "
                    "each other at every op; threads=null picks the free cores", n, cores)
    torch.set_num_threads(n)
    rule = "threads (set)" if requested is not None else "available cores - 1-minute load average, >= 1"
    # the malloc and OpenMP settings this process runs with (the CLI's start-up step, runner/startup.py)
    return {"threads": n, "available_cores": cores, "rule": rule, "runtime": runtime_info()}
