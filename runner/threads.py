"""How many CPU threads torch may use: decided once per job, deliberately, and reported.

torch's default is one thread per physical core. When another process is busy on one of those cores,
its OpenMP threads wait for each other at every op and a step can take 25x longer (measured here: a
tiny-model step at 720 ms with the default vs 28 ms with one thread, on 2 cores with one busy). So the
default counts the cores that are actually free: the cores this process may run on, less the load
already on the machine (the 1-minute load average, rounded), at least one. `threads=N` sets it.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    torch.set_num_threads(n)
    rule = "threads (set)" if requested is not None else "available cores - 1-minute load average, >= 1"
    return {"threads": n, "available_cores": cores, "rule": rule}
