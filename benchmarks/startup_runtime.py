"""Which process-level runtime settings speed up ladle's engine on this CPU.

vLLM-CPU preloads tcmalloc (and, in older releases, Intel's OpenMP runtime) and binds its OpenMP
threads to cores before torch starts. This script measures each of those on ladle's own workload, the
one benchmarks/vs_vllm.py runs (random Qwen3 166M, 32 prompts / ~12,000 prompt tokens x 32 greedy
tokens, step budget 512, max_num_seqs 64, fp32, eager), one subprocess per measurement, the
configurations alternated (the order rotates every repeat), at a fixed thread count.

Configurations (each is an environment the worker process starts with):
    base      nothing set (torch's bundled GNU libgomp, glibc malloc)
    tcmalloc  LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian: apt-get install libtcmalloc-minimal4)
    jemalloc  LD_PRELOAD=libjemalloc.so.2 (Debian: apt-get install libjemalloc2)
    bind      OMP_PROC_BIND=close OMP_PLACES=cores (libgomp pins thread i to core i)
    affinity  GOMP_CPU_AFFINITY=0-(n-1) (libgomp's own per-thread list)
    passive   OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep at once)
    active    OMP_WAIT_POLICY=ACTIVE (idle OpenMP threads spin until the next region)
    iomp5     LD_PRELOAD=libiomp5.so (the intel-openmp wheel's runtime takes over torch's GOMP_* calls)
    tc+bind   tcmalloc and bind together
    spin10k   GOMP_SPINCOUNT=10000 (spin briefly, then sleep; the default spins 300,000 rounds)
    tc+spinN  tcmalloc and GOMP_SPINCOUNT=N for N in 1k, 3k, 10k, 100k (one round ~25-35 ns here)
    tc+passive  tcmalloc and passive together: what ladle's start-up step set until 2026-11-24
    tc+passive+spin1k  what it sets now (runner/startup.py): libgomp spins 1,000 rounds, then sleeps
    glibc-tuned  GLIBC_TUNABLES=GLIBC_TUNED below (glibc malloc keeps freed memory; nothing to install)
    gt+passive  glibc-tuned and passive together

    .venv/bin/python benchmarks/startup_runtime.py [--threads 1,2] [--configs base,tcmalloc,...]
        [--repeats 4] [--write-docs]

Each worker also reports which of the libraries it really had mapped (/proc/self/maps) and the CPU
affinity of its threads, so a preload that silently failed shows up in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # this checkout's packages, whatever is installed

from ladle.runner.startup import find_malloc, library_dirs

TCMALLOC = find_malloc()  # what the CLI's start-up step would preload
JEMALLOC = next((d / "libjemalloc.so.2" for d in library_dirs() if (d / "libjemalloc.so.2").is_file()), None)
IOMP5_CANDIDATES = [REPO / "peer" / "lib" / "libiomp5.so", Path(sys.prefix) / "lib" / "libiomp5.so"]
# glibc malloc keeping freed memory instead of returning it to the kernel (which faults it in again,
# zeroed, at the next allocation): no mmap'd chunks (blocks over 32 MiB are always mmap'd otherwise) and
# a 1 GiB trim threshold; the price is that the process keeps its peak heap for good
GLIBC_TUNED = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
DEFAULT_CONFIGS = "base,tcmalloc,jemalloc,bind,affinity,passive,active,spin10k,iomp5,tc+bind,tc+passive"


def iomp5() -> Path | None:
    return next((p for p in IOMP5_CANDIDATES if p.exists()), None)


def config_env(name: str, threads: int) -> dict[str, str] | None:
    """The environment of one configuration; None when its library is not on this machine."""
    cores = f"0-{threads - 1}" if threads > 1 else "0"
    table: dict[str, dict[str, str | Path | None]] = {
        "base": {},
        "tcmalloc": {"LD_PRELOAD": TCMALLOC},
        "jemalloc": {"LD_PRELOAD": JEMALLOC},
        "bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
        "affinity": {"GOMP_CPU_AFFINITY": cores},
        "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
        "active": {"OMP_WAIT_POLICY": "ACTIVE"},
        "iomp5": {"LD_PRELOAD": iomp5()},
        "tc+bind": {"LD_PRELOAD": TCMALLOC, "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
        "spin10k": {"GOMP_SPINCOUNT": "10000"},
        "tc+passive": {"LD_PRELOAD": TCMALLOC, "OMP_WAIT_POLICY": "PASSIVE"},
        "tc+passive+thp": {"LD_PRELOAD": TCMALLOC, "OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"},
        "tc+spin1k": {"LD_PRELOAD": TCMALLOC, "GOMP_SPINCOUNT": "1000"},
        "tc+passive+spin1k": {"LD_PRELOAD": TCMALLOC, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
        "tc+spin3k": {"LD_PRELOAD": TCMALLOC, "GOMP_SPINCOUNT": "3000"},
        "tc+spin10k": {"LD_PRELOAD": TCMALLOC, "GOMP_SPINCOUNT": "10000"},
        "tc+spin100k": {"LD_PRELOAD": TCMALLOC, "GOMP_SPINCOUNT": "100000"},
        "glibc-tuned": {"GLIBC_TUNABLES": GLIBC_TUNED},
        "gt+passive": {"GLIBC_TUNABLES": GLIBC_TUNED, "OMP_WAIT_POLICY": "PASSIVE"},
    }
    env = table[name]
    if any(v is None for v in env.values()):
        return None
    return {k: str(v) for k, v in env.items()}


# -- worker ---------------------------------------------------------------------------------------
def mapped_libraries() -> list[str]:
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        base = os.path.basename(path)
        if any(k in base for k in ("tcmalloc", "jemalloc", "iomp5", "libgomp")):
            names.add(base)
    return sorted(names)


def thread_affinities() -> list[str]:
    out = []
    for task in sorted(Path("/proc/self/task").iterdir()):
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                out.append(line.split(":", 1)[1].strip())
    return out


def worker(args: argparse.Namespace) -> None:
    import vs_vllm

    prompts = json.loads(Path(args.prompts).read_text())
    ns = argparse.Namespace(threads=args.threads, model_dir=args.model_dir, mode="eager", budget=512,
                            max_num_seqs=64, output_len=args.output_len, worker="ladle")
    run = vs_vllm._ladle_runner(ns)
    run(prompts[:vs_vllm.WARMUP_PROMPTS], vs_vllm.WARMUP_TOKENS)
    timed = vs_vllm._timed(run, prompts, ns)
    seconds, tokens = timed["seconds"], timed["tokens"]
    # whole-process CPU time and page faults (load, warm-up and timed generate): the CPU time a config
    # costs is less disturbed by other jobs than its wall time
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(args.out).write_text(json.dumps({"seconds": seconds, "tokens": tokens, "libs": mapped_libraries(),
                                          "affinity": thread_affinities(), "user_s": ru.ru_utime,
                                          "sys_s": ru.ru_stime, "minflt": ru.ru_minflt}))


# -- orchestration --------------------------------------------------------------------------------
def run_one(name: str, env_extra: dict[str, str], threads: int, model_dir: Path, prompts_file: Path,
            work: Path, output_len: int) -> dict:
    out = work / f"{name}-{threads}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_", "LADLE_"))}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **env_extra)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model-dir", str(model_dir),
           "--prompts", str(prompts_file), "--threads", str(threads), "--out", str(out),
           "--output-len", str(output_len)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def measure(args: argparse.Namespace, threads: int, names: list[str], model_dir: Path, prompts_file: Path,
            work: Path) -> dict[str, dict]:
    import benchutil

    res: dict[str, dict] = {n: {"times": [], "ratios": [], "user": [], "sys": [], "minflt": [], "tokens": None,
                                "libs": None, "affinity": None} for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        got = {}
        for name in order:
            r = run_one(name, config_env(name, threads), threads, model_dir, prompts_file, work, args.output_len)
            got[name] = r["seconds"]
            res[name]["times"].append(r["seconds"])
            for key, field in (("user", "user_s"), ("sys", "sys_s"), ("minflt", "minflt")):
                res[name][key].append(r[field])
            res[name].update(tokens=r["tokens"], libs=r["libs"], affinity=r["affinity"])
            print(f"  threads={threads} rep {rep}: {name:10s} {r['seconds']:6.2f} s  cpu {r['user_s']:6.1f} user "
                  f"{r['sys_s']:5.1f} sys  {r['minflt'] / 1e6:.2f}M faults  libs={r['libs']} "
                  f"affinity={sorted(set(r['affinity']))} load={benchutil.load_average()}", flush=True)
        if "base" in got:
            for name in names:
                res[name]["ratios"].append(got["base"] / got[name])
    return res


def table_rows(threads: int, res: dict[str, dict]) -> list[list[object]]:
    import benchutil

    base_tokens = res.get("base", {}).get("tokens")
    rows = []
    for name, r in res.items():
        ts = sorted(r["times"])
        ratios = sorted(r["ratios"])
        same = "-" if base_tokens is None else f"{sum(a == b for a, b in zip(r['tokens'], base_tokens))}/{len(base_tokens)}"
        rows.append([threads, name, " / ".join(f"{t:.1f}" for t in ts),
                     f"{benchutil.median(ratios):.2f}x" if ratios else "-",
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-",
                     f"{benchutil.median(r['user']):.1f} / {benchutil.median(r['sys']):.1f}",
                     f"{benchutil.median(r['minflt']) / 1e6:.2f}M", same])
    return rows


def orchestrate(args: argparse.Namespace) -> None:
    import benchutil
    import vs_vllm

    model_dir = vs_vllm.workload_model(args)
    prompts = vs_vllm.make_prompts(args.num_prompts, args.prompt_tokens, args.seed, vs_vllm.ARCH["vocab_size"])
    work = Path(tempfile.mkdtemp(prefix="startup_runtime-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    load0 = benchutil.load_average()
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output tokens; "
          f"load {load0}")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        names = []
        for n in args.configs.split(","):
            if config_env(n, threads) is None:
                print(f"  {n}: its library is not on this machine; skipped")
            elif threads == 1 and n in ("passive", "active", "spin10k", "gt+passive"):
                print(f"  {n}: no OpenMP worker threads at threads=1; skipped")
            else:
                names.append(n)
        rows += table_rows(threads, measure(args, threads, names, model_dir, prompts_file, work))
    headers = ["threads", "config", "seconds (sorted)", "speed vs base (median of per-repeat ratios)",
               "ratio range", "CPU s user / sys (median, whole process)", "page faults (median)", "tokens = base"]
    table = benchutil.markdown_table(headers, rows)
    load1 = benchutil.load_average()
    print(table)
    print(f"load at the start {load0}, at the end {load1}")
    if args.write_docs:
        body = (f"Command: `.venv/bin/python benchmarks/startup_runtime.py --threads {args.threads} --configs "
                f"{args.configs} --repeats {args.repeats}`\n\nWorkload: benchmarks/vs_vllm.py's ladle worker "
                f"(random Qwen3 166M, fp32, eager, {len(prompts)} prompts / {sum(map(len, prompts))} prompt "
                f"tokens x {args.output_len} greedy tokens, budget 512), one process per measurement, "
                f"configurations rotated every repeat. Load average at the start {load0}, at the end {load1}."
                f"\n\n{table}\n")
        benchutil.write_docs_section("startup_runtime", body)


def main() -> None:
    import vs_vllm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--repeats", type=int, default=4)
    vs_vllm.add_workload_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
