"""executor=ray with its rows in an S3 API server and its outputs kept there (output.path): rows/s through
1 and 2 replicas, and the driver's peak RSS for a quarter of the rows and for all of them.

    .venv/bin/python benchmarks/ray_store.py --rows 200000 --replicas 1,2

A moto server (127.0.0.1, a free port) plays S3; the tiny built-in model (random weights) runs one output
token per row, so the rows, not the model, are what is measured. rows/s (process) counts from the
config's composition to the end (Ray's start included); rows/s (job) from the replicas' launch to the
merged outputs in the store (summary.json's wall_time_s: actor start and model load included). Each measurement is one `run_job` in a
fresh Python process (its own Ray local cluster), which prints its own VmHWM: the driver's peak resident
memory, Ray's workers not included. Within 1.2x between a quarter and all of the rows means the driver's
memory does not grow with the data set.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from hydra import compose, initialize_config_dir
from ladle.runner.config import CONF_DIR, register_configs
from ladle.runner.job import run_job
register_configs()
overrides, out = json.loads(sys.argv[1]), sys.argv[2]
with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    cfg = compose("config", overrides=overrides)
t = time.perf_counter()
res = run_job(cfg, out)
wall = time.perf_counter() - t
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"wall_s": wall, "job_wall_s": res.summary["wall_time_s"], "requests": res.summary["requests"],
                  "driver_peak_rss_mib": hwm / 1024}))
"""


def measure(uri: str, rows: int, replicas: int, out_uri: str, workdir: Path) -> dict:
    overrides = ["workload=parquet", f"workload.path={uri}", f"workload.limit={rows}", "executor=ray",
                 f"executor.num_replicas={replicas}", "executor.batch_size=4096", "sampling.max_tokens=1",
                 "max_num_seqs=256", "cache.max_model_len=64", "output.plots=false", "output.progress=false",
                 "output.print_summary=false", "output.include_prompt=false", f"output.path={out_uri}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), str(workdir)], env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    return {"rows": rows, "replicas": replicas, **result, "rows_per_s": result["requests"] / result["wall_s"],
            "job_rows_per_s": result["requests"] / result["job_wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--replicas", default="1,2")
    args = ap.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bench")
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    prompts = [f"{words[i % 8]} {words[(i // 8) % 8]} {i}" for i in range(args.rows)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": prompts}), buf, row_group_size=8192)
    s3.put_object(Bucket="bench", Key="in/prompts.parquet", Body=buf.getvalue())
    uri = "s3://bench/in/prompts.parquet"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in (int(r) for r in args.replicas.split(",")):
            for rows in (args.rows // 4, args.rows):
                name = f"r{replicas}_{rows}_{time.time_ns()}"
                r = measure(uri, rows, replicas, f"s3://bench/out/{name}", Path(tmp) / name)
                results.append(r)
                print(json.dumps(r), flush=True)
    server.stop()
    print("\n| replicas | rows | rows/s (process) | rows/s (job) | driver peak RSS (MiB) |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['replicas']} | {r['rows']:,} | {r['rows_per_s']:.0f} | {r['job_rows_per_s']:.0f} | "
              f"{r['driver_peak_rss_mib']:.0f} |")
    for replicas in sorted({r["replicas"] for r in results}):
        quarter, full = (r["driver_peak_rss_mib"] for r in results if r["replicas"] == replicas)
        print(f"{replicas} replica(s): driver peak RSS at all rows / at a quarter = {full / quarter:.2f}x")


if __name__ == "__main__":
    main()
