"""ladle alone on vs_vllm.py's workload, two or more variants alternated: is a change faster end to end?

Each variant is a label and environment assignments (`--variant gated=LADLE_GEMM_GATED=1`), or a label and
another checkout (`--variant before=@/tmp/before`: that tree's engine code, under this script's worker).
One process per measurement, exactly as vs_vllm.py runs ladle (its CLI's start-up environment: tcmalloc,
OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), the variants' order rotating every repeat; or, with --persistent,
one resident worker per variant and cell (loaded and warmed up once), their timed generates rotated seconds
apart. Reports each variant's wall seconds of the timed generate and its CPU seconds (every thread of the
process; on a shared machine the CPU clock is the steadier of the two at 1 thread), medians and the median of
per-repeat ratios against the first variant, and whether every variant produced the first one's tokens in
every repeat.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/ladle_ab.py --threads 1,2 --repeats 4 \\
        --variant off=LADLE_GEMM_GATED=0 --variant on=LADLE_GEMM_GATED=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import vs_vllm


def parse_variant(text: str) -> tuple[str, dict[str, str], str | None]:
    label, _, rest = text.partition("=")
    if rest.startswith("@"):
        return label, {}, rest[1:]
    env = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        env[key] = value
    return label, env, None


def _variant_env(env_extra: dict[str, str], source: str | None) -> dict[str, str]:
    """The variant's switches, and its checkout first on PYTHONPATH."""
    env = dict(env_extra)
    if source:
        env["PYTHONPATH"] = source + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def run_one(env_extra: dict[str, str], source: str | None, threads: int, mode: str, args, model_dir: Path,
            prompts_file: Path, work: Path) -> dict:
    """One ladle measurement as vs_vllm.py runs it (its CLI's start-up environment), with the variant's
    switches, or its checkout first on PYTHONPATH."""
    return vs_vllm.run_worker(Path(sys.executable), "ladle", args, threads, mode, model_dir, prompts_file, work,
                              extra_env=_variant_env(env_extra, source), cwd=Path(source) if source else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True,
                   help="label=VAR=value[,VAR=value] or label=@DIR (repeatable; the first is the baseline)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--modes", default="eager")
    p.add_argument("--repeats", type=int, default=3)
    vs_vllm.add_workload_args(p)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--persistent", action="store_true",
                   help="one resident worker per variant and cell, timed generates rotated between them (vs_vllm.py "
                        "--persistent), instead of a process per measurement")
    args = p.parse_args()
    args.no_startup = False  # the CLI's start-up environment, as vs_vllm.py's ladle worker gets by default
    import benchutil

    variants = [parse_variant(v) for v in args.variant]
    vs_vllm.exit_on_sigterm()
    model_dir = vs_vllm.workload_model(args)
    prompts = vs_vllm.make_prompts(args.num_prompts, args.prompt_tokens, 0, vs_vllm.ARCH["vocab_size"])
    work = Path(tempfile.mkdtemp(prefix="ladle_ab-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(f"load at the start: {benchutil.load_average()}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            wall = {v[0]: [] for v in variants}
            cpu = {v[0]: [] for v in variants}
            tokens: dict[str, list] = {}
            same = {v[0]: True for v in variants}  # the first variant's tokens in every repeat
            served: dict[str, vs_vllm.ServedWorker] = {}
            try:
                if args.persistent:
                    for label, env, source in variants:
                        served[label] = vs_vllm.ServedWorker(
                            Path(sys.executable), "ladle", args, threads, mode, model_dir, prompts_file, work,
                            extra_env=_variant_env(env, source), cwd=Path(source) if source else None)
                for rep in range(args.repeats):
                    k = rep % len(variants)
                    order = variants[k:] + variants[:k]
                    for label, env, source in order:
                        res = (served[label].measure() if served else
                               run_one(env, source, threads, mode, args, model_dir, prompts_file, work))
                        wall[label].append(res["seconds"])
                        cpu[label].append(res.get("cpu_seconds") or float("nan"))
                        tokens[label] = res["tokens"]
                        print(f"  {mode} threads={threads} rep {rep} {label}: wall {res['seconds']:.3f} s, "
                              f"cpu {cpu[label][-1]:.3f} s", flush=True)
                    for label, _, _ in variants:
                        same[label] = same[label] and tokens[label] == tokens[variants[0][0]]
            finally:
                for worker in served.values():
                    worker.close()
            base = variants[0][0]
            for label, _, _ in variants:
                wr = [wall[base][i] / wall[label][i] for i in range(args.repeats)]
                cr = [cpu[base][i] / cpu[label][i] for i in range(args.repeats)]
                rows.append([threads, mode, label, " / ".join(f"{t:.2f}" for t in sorted(wall[label])),
                             f"{statistics.median(wr):.3f}x", " / ".join(f"{t:.2f}" for t in sorted(cpu[label])),
                             f"{statistics.median(cr):.3f}x", "yes" if same[label] else "NO"])
    print(f"load at the end: {benchutil.load_average()}")
    print(benchutil.markdown_table(
        ["threads", "mode", "variant", "wall s (sorted)", f"speed vs {variants[0][0]} (median ratio)",
         "CPU s (sorted)", "CPU speed (median ratio)", "same tokens"], rows))


if __name__ == "__main__":
    main()
