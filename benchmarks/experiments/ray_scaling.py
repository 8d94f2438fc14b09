"""executor=ray scaling: the same job at 1 and 2 replicas (and executor=local for Ray's overhead).

Each configuration runs the same synthetic workload through `ladle.runner.job.run_job` (what
`python -m runner` runs), on one local Ray cluster started once by this script, one torch thread per
replica (`threads=1`, `executor.num_cpus_per_replica=1`). `procs x2` is the ceiling on this machine:
two plain processes (no Ray), each an executor=local job over half the requests, started together. The model is a random-weight Qwen3 larger
than `tiny` (--hidden, --layers), so a replica's engine work dominates Ray's fixed costs (starting the
actors, building an engine in each, merging the files). Configurations are alternated in every repeat.

Reported per configuration (medians over --repeats):
- wall s: the whole run_job call, Ray's fixed costs included;
- req/s wall, out tok/s wall: requests and output tokens over that wall time;
- out tok/s span: summary.json's output tokens per second of the run's span (per replica: first
  arrival to last finish of engine time; the replicas run side by side, so the longest one);
- ratio: 2 replicas over 1 replica, within each repeat, then the median.

    OMP_NUM_THREADS=1 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/ray_scaling.py
    OMP_NUM_THREADS=1 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/ray_scaling.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from hydra import compose, initialize_config_dir

from ladle.runner.config import CONF_DIR, register_configs


def overrides(args: argparse.Namespace, replicas: int | None) -> list[str]:
    over = [
        "workload=synthetic", f"workload.synthetic.groups.0.num_requests={args.requests}",
        f"workload.synthetic.groups.0.prompt_len={args.prompt_len}", "workload.synthetic.groups.0.prompt_len_sigma=0",
        f"workload.synthetic.groups.0.max_tokens={args.max_tokens}", "workload.synthetic.groups.0.max_tokens_sigma=0",
        f"model.architecture.hidden_size={args.hidden}", f"model.architecture.intermediate_size={3 * args.hidden}",
        f"model.architecture.num_hidden_layers={args.layers}", f"max_num_seqs={args.max_num_seqs}",
        "threads=1", "output.plots=false", "output.progress=false", "output.print_summary=false",
    ]
    if replicas is not None:
        over += ["executor=ray", f"executor.num_replicas={replicas}", "executor.num_cpus_per_replica=1",
                 f"executor.batch_size={args.block}"]
    return over


def _local_job(args: argparse.Namespace, out: Path) -> dict:
    """One executor=local job (in a process of its own for the `procs x2` baseline)."""
    from ladle.runner.job import run_job

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides(args, None))
    return run_job(cfg, out).summary


def run_once(args: argparse.Namespace, config: str, out: Path) -> dict[str, float]:
    """`local`, `ray xN`, or `procs x2`: two plain processes (no Ray) each running half the requests,
    the most two replicas could give on this machine at that moment."""
    from ladle.runner.job import run_job

    t0 = time.perf_counter()
    if config == "procs x2":
        half = argparse.Namespace(**{**vars(args), "requests": args.requests // 2})
        with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_local_job, [half, half], [out / "p0", out / "p1"]))
        wall = time.perf_counter() - t0
        requests = sum(s["requests"] for s in parts)
        tokens = sum(s["tokens"]["output"] for s in parts)
        span = tokens / max(s["duration_s"] for s in parts)
    else:
        replicas = None if config == "local" else int(config.split("x")[1])
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides(args, replicas))
        s = run_job(cfg, out).summary
        wall = time.perf_counter() - t0
        requests, tokens, span = s["requests"], s["tokens"]["output"], s["throughput"]["output_tokens_per_s"]
    assert requests == args.requests - args.requests % 2 * (config == "procs x2"), requests
    return {"wall_s": wall, "req_per_s_wall": requests / wall, "out_tok_per_s_wall": tokens / wall,
            "out_tok_per_s_span": span}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--block", type=int, default=16, help="executor.batch_size: rows routed together")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a small run to check the script")
    p.add_argument("--nice15", action="store_true", help="replicas at Ray's default niceness 15, not 0")
    args = p.parse_args()
    if args.quick:
        args.requests, args.hidden, args.layers, args.repeats = 32, 128, 4, 1
    register_configs()
    import ray

    from ladle.runner.executors.checks import connect

    if args.nice15:
        os.environ["RAY_worker_niceness"] = "15"  # Ray's own default, which executor=ray overrides
    connect(None)  # the local cluster executor=ray starts (all cores, replicas at nice 0), started once
    configs = ["local", "procs x2", "ray x1", "ray x2"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    keys = ("out_tok_per_s_wall", "out_tok_per_s_span")
    ratios: dict[str, list[float]] = {f"ray x2 / ray x1 {k}": [] for k in keys}
    ratios.update({f"procs x2 / local {k}": [] for k in keys})
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="ray_scaling_") as tmp:
        for rep in range(args.repeats):
            for name in configs:
                r = run_once(args, name, Path(tmp) / f"{name.replace(' ', '')}_{rep}")
                results[name].append(r)
                print(f"repeat {rep} {name:7s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
                load.append(os.getloadavg()[0])
            for k in keys:
                ratios[f"ray x2 / ray x1 {k}"].append(results["ray x2"][-1][k] / results["ray x1"][-1][k])
                ratios[f"procs x2 / local {k}"].append(results["procs x2"][-1][k] / results["local"][-1][k])
    cpus = ray.cluster_resources().get("CPU")
    ray.shutdown()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    print("\n| config | wall s | req/s wall | out tok/s wall | out tok/s span |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['wall_s']:.1f} | {m['req_per_s_wall']:.2f} | {m['out_tok_per_s_wall']:.0f} "
              f"| {m['out_tok_per_s_span']:.0f} |")
    print("\nratios within each repeat (median, then each repeat's):")
    for k, v in ratios.items():
        print(f"  {k}: {statistics.median(v):.2f}x ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"load average (1 min) during the runs: {min(load):.1f}-{max(load):.1f}; Ray cluster: {cpus} CPUs; "
          f"worker niceness {os.environ.get('RAY_worker_niceness')}")
    print(json.dumps({"args": vars(args), "median": med, "ratios": ratios, "load": load, "raw": results}))


if __name__ == "__main__":
    main()
