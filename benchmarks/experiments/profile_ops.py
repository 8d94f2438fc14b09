"""Where the time of the vs_vllm workload goes, by op, at 1 and 2 threads; before and after a change.

Runs benchmarks/vs_vllm.py's ladle workload (random Qwen3 166M, 32 prompts / ~12,000 prompt tokens,
32 greedy tokens each, step budget 512, fp32, eager) under torch.profiler, one process per
measurement, and reports each op's self time in seconds. The C++ attention kernel is called through
ctypes, which the profiler cannot see: it is wrapped in a record_function named
`ladle::cpu_paged_attention` (and the fused CPU kernels `ladle::add_rms_norm`, `ladle::gated_activation`,
`ladle::qk_norm_rope`, and the linear layers' `ladle::cpu_gemm`, where the checkout has them; the CPU layer
stack, which runs every layer but the last from C++, is one `ladle::cpu_layer_stack`: `LADLE_CPU_STACK=0` in
the environment shows its kernels one by one, as the layers then run op by op). Since the
gated form (kernels/cpu_gemm), a gated MLP's activation runs inside its down projection's `ladle::cpu_gemm`
(`LADLE_GEMM_GATED=0` in the environment: the separate `ladle::gated_activation` again). "other" is the
timed generate's wall time less every op's self time: Python, scheduling, sampling.

`--source DIR` (repeatable, `label=DIR`) profiles the engine code of another checkout, e.g. the
revision before a change (`git worktree add /tmp/before <commit>`); sources alternate within a thread
count so the machine's drift hits them alike.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/profile_ops.py --threads 1,2 --source before=/tmp/before --source after=.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = 12


def _wrap_untraced_kernels() -> None:
    """Give ctypes-called kernels a name in the profile (they are invisible to it otherwise)."""
    import torch

    def named(module, attr: str, label: str) -> None:
        fn = getattr(module, attr, None)
        if fn is None:
            return

        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        setattr(module, attr, wrapper)

    from ladle.kernels import cpu_paged

    named(cpu_paged, "cpu_paged_attention", "ladle::cpu_paged_attention")
    try:
        from ladle.kernels import cpu_gemm
        named(cpu_gemm, "gemm", "ladle::cpu_gemm")
    except ImportError:  # a checkout from before the GEMM kernel
        pass
    try:
        from ladle.kernels import cpu_fused
    except ImportError:  # a checkout from before the fused kernels
        return
    for name in ("add_rms_norm", "gated_activation", "qk_norm_rope"):
        named(cpu_fused, name, f"ladle::{name}")
    try:
        from ladle.kernels import cpu_layers
    except ImportError:  # a checkout from before the layer stack
        return
    named(cpu_layers, "run", "ladle::cpu_layer_stack")


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.source[0])
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    import vs_vllm

    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams

    _wrap_untraced_kernels()
    model_dir = Path(args.cache_dir) / "qwen3-166m"
    prompts = vs_vllm.make_prompts(args.num_prompts, args.prompt_tokens, 0, vs_vllm.ARCH["vocab_size"])
    eng = LLMEngine(EngineConfig(
        model=ModelConfig(name="profile", path=str(model_dir), tokenizer="byte", dtype="float32", device="cpu"),
        cache=CacheConfig(backend="paged", block_size=16, max_model_len=4096, prefix_caching=False),
        chunking=ChunkingConfig(enabled=True, size=args.budget, token_budget=args.budget),
        max_num_seqs=64,
    ))
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        wall = time.perf_counter() - t0
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    # A record_function's self time is the wrapped kernel's (it calls no op but torch.empty).
    Path(args.out).write_text(json.dumps({"wall": wall, "ops": ops}))


def run_one(source: str, threads: int, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--source", source, "--threads", str(threads),
           "--out", str(out), "--cache-dir", args.cache_dir, "--num-prompts", str(args.num_prompts),
           "--prompt-tokens", str(args.prompt_tokens), "--output-len", str(args.output_len),
           "--budget", str(args.budget)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"profile worker ({source}, {threads} threads) failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def table(results: dict[tuple[str, int], dict], labels: list[str], threads: list[int]) -> str:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchutil

    totals: dict[str, float] = {}
    for res in results.values():
        for op, s in res["ops"].items():
            totals[op] = totals.get(op, 0.0) + s
    top = sorted(totals, key=totals.get, reverse=True)[:TOP]
    cols = [(label, t) for t in threads for label in labels]
    headers = ["op"] + [f"{label}, {t} thr (s)" for label, t in cols]
    rows = []
    for op in top:
        rows.append([op] + [f"{results[c]['ops'].get(op, 0.0):.2f}" for c in cols])
    rows.append(["other ops"] + [f"{sum(s for o, s in results[c]['ops'].items() if o not in top):.2f}" for c in cols])
    rows.append(["outside ops (Python, host)"]
                + [f"{results[c]['wall'] - sum(results[c]['ops'].values()):.2f}" for c in cols])
    rows.append(["**wall**"] + [f"**{results[c]['wall']:.2f}**" for c in cols])
    return benchutil.markdown_table(headers, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--source", action="append", help="label=DIR of a checkout to profile (repeatable)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=1, help="the fastest repeat of each is reported")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=12000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "ladle-bench"))
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchutil
    import vs_vllm

    vs_vllm.make_model(Path(args.cache_dir) / "qwen3-166m")
    sources = [s.split("=", 1) if "=" in s else (Path(s).name, s) for s in (args.source or [f"this={REPO}"])]
    labels = [label for label, _ in sources]
    threads = [int(t) for t in args.threads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="profile_ops-"))
    load = benchutil.load_average()
    print(f"load: {load}", flush=True)
    results: dict[tuple[str, int], dict] = {}
    for t in threads:
        for rep in range(args.repeats):
            for label, src in sources if rep % 2 == 0 else sources[::-1]:
                res = run_one(str(Path(src).resolve()), t, args, work)
                print(f"  {label} {t} threads rep {rep}: {res['wall']:.2f} s", flush=True)
                if (label, t) not in results or res["wall"] < results[(label, t)]["wall"]:
                    results[(label, t)] = res
    text = table(results, labels, threads)
    print(text)
    if args.write_docs:
        command = " ".join(["benchmarks/experiments/profile_ops.py", "--threads", args.threads, "--repeats", str(args.repeats),
                            *[f"--source {label}=..." for label in labels]])
        body = (f"Command: `.venv/bin/python {command}` (sources: {', '.join(f'{lb} = {src}' for lb, src in sources)}).\n"
                f"Self seconds by op of the timed generate (the vs_vllm workload, eager, fp32; the fastest of "
                f"{args.repeats} per column); load average at the start: {load}, at the end: "
                f"{benchutil.load_average()}.\n\n{text}\n")
        benchutil.write_docs_section("profile_ops", body)


if __name__ == "__main__":
    main()
