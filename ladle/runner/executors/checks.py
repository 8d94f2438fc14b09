"""Executor config checks: the values alone at config time, the Ray cluster once it is reached.

Every problem is a ConfigError (exit 2) naming the key and the fix, raised before any model loads.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ladle.runner.config import ConfigError, JobConfig

log = logging.getLogger("ladle")

EXECUTORS = ("local", "ray")
INSTALL_RAY = "pip install -e '.[ray]' (or pip install 'ray[data]')"


def check_executor(job: JobConfig) -> None:
    """The executor's values, without starting anything."""
    ex = job.executor
    if ex.kind not in EXECUTORS:
        raise ConfigError(f"executor.kind={ex.kind!r} is invalid: use executor=local or executor=ray")
    if ex.kind != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(f"executor=ray needs Ray, which is not installed: {INSTALL_RAY}") from None
    if ex.num_replicas < 1:
        raise ConfigError(f"executor.num_replicas={ex.num_replicas} must be >= 1")
    if ex.batch_size < 1:
        raise ConfigError(f"executor.batch_size={ex.batch_size} must be >= 1 (rows routed to a replica together)")
    if ex.max_restarts < 0:
        raise ConfigError(f"executor.max_restarts={ex.max_restarts} must be >= 0")
    if ex.num_cpus_per_replica < 0 or ex.num_gpus_per_replica < 0:
        raise ConfigError(f"executor.num_cpus_per_replica={ex.num_cpus_per_replica} and "
                          f"executor.num_gpus_per_replica={ex.num_gpus_per_replica} must be >= 0")
    if ex.num_gpus_per_replica > 0 and job.model.device == "cpu":
        raise ConfigError(f"executor.num_gpus_per_replica={ex.num_gpus_per_replica} with model.device=cpu: "
                          "the replicas would hold GPUs they never use; set executor.num_gpus_per_replica=0 "
                          "or model.device=cuda")
    if ex.num_gpus_per_replica == 0 and job.model.device.startswith("cuda"):
        raise ConfigError(f"model.device={job.model.device} needs executor.num_gpus_per_replica > 0 "
                          "(a replica sees only the GPUs Ray gives it)")
    if ex.address and ex.address != "auto":
        _check_reachable(ex.address)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A TCP connect to host:port (GCS, or ray:// client server), so a wrong address fails in seconds."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"executor.address={address!r} is not host:port, ray://host:port or auto "
                          "(the head's address from `ray start --head`)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"executor.address={address!r} is unreachable ({e.strerror or e}): start the head "
                          "with `ray start --head` and use the address it prints, or executor.address=null "
                          "for a local cluster") from None


def connect(address: str | None) -> None:
    """ray.init, or reuse the connection of an earlier run in this process (Hydra --multirun calls the
    task once per run in one process; starting a second cluster would fail)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        # Ray starts its workers at nice 15 so that its own daemons stay responsive; on a local cluster
        # the replicas are the job itself, and at nice 15 any other busy process on the machine takes
        # the cores from them (seen on the shared test machine). A joined cluster keeps its setting.
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"could not reach a Ray cluster at executor.address={address!r}: {first} "
                          "(start one with `ray start --head`, or executor.address=null for a local one)") from None


def check_resources(job: JobConfig, replicas: int) -> None:
    """Every replica must fit the cluster: a replica that cannot be placed would wait forever. A joined
    cluster (executor.address set) may autoscale, so there a shortfall is only a warning."""
    import ray

    ex = job.executor
    total = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for res, per in (("CPU", ex.num_cpus_per_replica), ("GPU", ex.num_gpus_per_replica)):
        key = f"executor.num_{res.lower()}s_per_replica"
        biggest = max((n.get(res, 0.0) for n in nodes), default=0.0)
        if per > biggest:
            raise ConfigError(f"{key}={per} is more than any node of the Ray cluster has ({biggest:g} {res}s): "
                              f"lower it (fractions are fine, e.g. {key}=0.5)")
        need, have = per * replicas, total.get(res, 0.0)
        if need > have:
            msg = (f"executor.num_replicas={replicas} x {key}={per} = {need:g} {res}s, the Ray cluster has "
                   f"{have:g}: lower {key} (fractions are fine) or executor.num_replicas")
            if job.executor.address is None:
                raise ConfigError(msg)
            log.warning("%s; the replicas that do not fit wait for an autoscaler to add nodes", msg)


def describe_cluster() -> dict[str, Any]:
    import ray

    r = ray.cluster_resources()
    return {"cpus": r.get("CPU", 0.0), "gpus": r.get("GPU", 0.0), "nodes": len([n for n in ray.nodes() if n["Alive"]])}
