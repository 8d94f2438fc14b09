"""Forward efficiency: the model forward's FLOP/s over a whole offline run vs torch's own GEMM throughput
on the same shapes and token counts; eager vs compiled (model.compile); 1 vs 2 threads.

The workload is throughput_vs_transformers' (the qwen3_0_6b architecture, random weights drawn with
initializer_range 0.1, lognormal prompt lengths, all at t=0, greedy, EOS ignored, fp32, token budget 512,
max 64 sequences), smaller by default so that the four runs fit a few minutes.

Each (threads, mode) configuration runs in its own subprocess (torch's thread count, and the thread
count inductor compiles its C++ for, are per process). In it, every model forward and LM-head call of
the run is timed (the run's `ModelRunner` calls go through a timing proxy; on the CPU no sync is
needed), with its token count. Then, in the same process at the same thread count, torch.matmul (as
F.linear) of the decoder layer's four weight shapes (qkv, o, gate_up, down) is timed right after
every step at the token count of each of its forwards, and the LM head's at its sampled-row count
(interleaved with the steps, so the reference sees the same machine load as the forward it stands
for; its time is left out of the run's wall time). The GEMM reference time of the run is the sum over
forwards of layers x (the four GEMMs at that width) + the LM head's GEMM: what the forward would cost
if it were nothing but torch's matmuls. The last layer runs o/gate_up/down on the rows the forward
returns only (AttentionMetadata.restrict_outputs: the sampling rows), so its three are counted and
timed at that row count. Reported:

- forward GFLOP/s = matmul FLOPs of the run (2 x tokens x weight elements, decoder and LM head;
  attention's own FLOPs not counted) / seconds in forwards;
- GEMM GFLOP/s = the same FLOPs / the GEMM reference time; efficiency = their ratio;
- the run's wall time, compile time (once, in the engine's warm-up, before the first step), the first
  step's time against the median step, graphs compiled during the run, and whether the greedy outputs
  of every configuration are identical.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/forward_efficiency.py --quick
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/forward_efficiency.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import benchutil as bu
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


class TimedModel:
    """Stands in for the model in the ModelRunner: times each forward and LM-head call."""

    def __init__(self, model):
        self.model = model
        self.forwards: list[tuple[int, int, float]] = []  # (tokens, rows returned, seconds)
        self.heads: list[tuple[int, float]] = []  # (sampled rows, seconds)

    def __call__(self, ids, positions, kv_caches, meta):
        t0 = time.perf_counter()
        hidden = self.model(ids, positions, kv_caches, meta)
        self.forwards.append((int(ids.shape[0]), int(hidden.shape[0]), time.perf_counter() - t0))
        return hidden

    def __getattr__(self, name):  # everything else the runner reads (arch, ...) is the model's
        return getattr(self.model, name)

    def compute_logits(self, hidden):
        t0 = time.perf_counter()
        logits = self.model.compute_logits(hidden)
        self.heads.append((int(hidden.shape[0]), time.perf_counter() - t0))
        return logits


def layer_shapes(arch: dict) -> list[tuple[int, int]]:
    """(out, in) of the packed per-layer weights: qkv, o, gate_up, down."""
    h, d = arch["hidden_size"], arch["head_dim"]
    q, kv, inter = arch["num_attention_heads"] * d, arch["num_key_value_heads"] * d, arch["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]


class GemmReference:
    """torch's own matmuls (F.linear, fp32) on the layer's and the LM head's weight shapes, timed at a
    given token count. Weights are made once; inputs are row slices of one random buffer."""

    def __init__(self, shapes: list[tuple[int, int]], head: tuple[int, int], max_tokens: int):
        self.layer = [torch.randn(o, i) for o, i in shapes]
        self.head = torch.randn(*head)
        widest = max(i for _, i in [*shapes, head])
        self.x = {i: torch.randn(max_tokens, i) for i in {i for _, i in [*shapes, head]}}
        assert widest in self.x
        for n in (1, max_tokens):  # first calls: allocation, kernel selection
            self.layer_seconds(n)
            self.head_seconds(n)

    def _time(self, w: torch.Tensor, n: int) -> float:
        x = self.x[w.shape[1]][:n]
        t0 = time.perf_counter()
        F.linear(x, w)
        return time.perf_counter() - t0

    def layer_seconds(self, n: int, kept: int | None = None) -> float:
        """One layer's four GEMMs at n rows; kept: the last layer's, o/gate_up/down at the kept rows."""
        qkv, *rest = self.layer
        return self._time(qkv, n) + sum(self._time(w, n if kept is None else kept) for w in rest)

    def head_seconds(self, n: int) -> float:
        return self._time(self.head, n)


def forward_flops(shapes: list[tuple[int, int]], layers: int, tokens: int, kept: int) -> int:
    """Matmul FLOPs of one forward of `tokens` rows returning `kept`: every layer's four GEMMs on every
    row, but the last layer's o/gate_up/down on the kept rows only."""
    (qkv_out, qkv_in), *rest = shapes
    per_row = sum(o * i for o, i in rest)
    return 2 * (layers * tokens * qkv_out * qkv_in + ((layers - 1) * tokens + kept) * per_row)


def run_one(args) -> dict:
    """One configuration, in this process: the engine run, then the GEMM reference."""
    from throughput_vs_transformers import make_prompts
    from torch._dynamo.utils import counters

    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams

    threads = bu.set_threads(args.threads)
    bu.quiet_random_weights()
    arch = bu.qwen3_architecture(initializer_range=args.init_std, num_hidden_layers=args.layers)
    prompts = make_prompts(args.num_requests, args.median_prompt, args.sigma, args.max_prompt, args.min_prompt,
                           arch["vocab_size"], args.seed)
    max_model_len = max(len(p) for p in prompts) + args.output_len
    mc = bu.engine_model_config(arch, seed=args.seed)
    mc.compile = args.mode == "compiled"
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(
        model=mc,
        cache=CacheConfig(block_size=16, max_model_len=max_model_len, prefix_caching=False,
                          num_blocks=sum(math.ceil((len(p) + args.output_len) / 16) for p in prompts)),
        chunking=ChunkingConfig(size=args.token_budget, token_budget=args.token_budget),
        max_num_seqs=args.max_num_seqs,
    ))
    build_s = time.perf_counter() - t0
    timed = TimedModel(eng.model)
    eng.model_runner.model = timed
    shapes = layer_shapes(arch)
    layers, hidden, vocab = arch["num_hidden_layers"], arch["hidden_size"], arch["vocab_size"]
    ref = GemmReference(shapes, (vocab, hidden), args.token_budget)
    graphs_before = counters["stats"]["unique_graphs"]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    done, steps = {}, []
    gemm_s = ref_s = 0.0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        nf, nh = len(timed.forwards), len(timed.heads)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        steps.append(eng.last_step.duration)
        # The reference right after the step, under the same load: one layer's GEMMs x layers.
        r0 = time.perf_counter()
        gemm_s += sum((layers - 1) * ref.layer_seconds(n) + ref.layer_seconds(n, kept)
                      for n, kept, _ in timed.forwards[nf:])
        gemm_s += sum(ref.head_seconds(n) for n, _ in timed.heads[nh:])
        ref_s += time.perf_counter() - r0
    wall = time.perf_counter() - t0 - ref_s
    outputs = [done[i].output_token_ids for i in ids]
    graphs_during = counters["stats"]["unique_graphs"] - graphs_before

    flops = (sum(forward_flops(shapes, layers, n, kept) for n, kept, _ in timed.forwards)
             + sum(2 * n * vocab * hidden for n, _ in timed.heads))
    forward_s = sum(s for *_, s in timed.forwards) + sum(s for _, s in timed.heads)
    widths = {n for n, *_ in timed.forwards}
    return {
        "mode": args.mode, "threads": threads, "wall_s": wall, "build_s": build_s,
        "compile_s": eng.compile_seconds, "forward_s": forward_s, "gemm_s": gemm_s, "gflop": flops / 1e9,
        "forwards": len(timed.forwards), "distinct_widths": len(widths), "steps": len(steps),
        "first_step_s": steps[0], "median_step_s": bu.median(steps), "max_step_s": max(steps),
        "graphs_compiled_during_run": graphs_during, "outputs": outputs,
        "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": args.output_len * len(prompts),
        "arch": arch, "load_before": bu.load_average(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers, 8 short requests")
    ap.add_argument("--write-docs", action="store_true", help="write the report to benchmarks/results/")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--median-prompt", type=int, default=64)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (qwen3_0_6b has 28)")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads-list", default="1,2", help="thread counts to compare")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--save", help="write the configurations' results (JSON) here")
    ap.add_argument("--load", help="report (and --write-docs) results saved with --save instead of running")
    # Internal: run one configuration and print its JSON.
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.num_requests, args.median_prompt, args.max_prompt, args.output_len = 4, 8, 32, 96, 8
    if args.one:
        print("RESULT " + json.dumps(run_one(args)))
        return

    passthrough = [a for a in sys.argv[1:] if a not in ("--write-docs",)]
    results = json.loads(Path(args.load).read_text()) if args.load else []
    for threads in [] if args.load else [int(t) for t in args.threads_list.split(",")]:
        for mode in args.modes.split(","):
            cmd = [sys.executable, str(HERE / "forward_efficiency.py"), *passthrough, "--one",
                   "--threads", str(threads), "--mode", mode]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{mode} at {threads} threads failed:\n{proc.stderr[-4000:]}")
            r = json.loads(line[len("RESULT "):])
            results.append(r)
            print(f"{mode:>8} {threads} thread(s): run {r['wall_s']:.1f}s, forwards {r['forward_s']:.1f}s, "
                  f"GEMM reference {r['gemm_s']:.1f}s, efficiency {r['gemm_s'] / r['forward_s']:.0%}, "
                  f"compile {r['compile_s'] or 0:.1f}s, graphs compiled in the run "
                  f"{r['graphs_compiled_during_run']}, load before {r['load_before']}", flush=True)

    if args.save:
        Path(args.save).write_text(json.dumps(results))
    base = results[0]["outputs"]
    identical = all(r["outputs"] == base for r in results)
    rows = []
    for r in results:
        one = next(x for x in results if x["mode"] == r["mode"] and x["threads"] == 1)
        rows.append([
            r["mode"], r["threads"], r["wall_s"], r["forward_s"], r["gemm_s"], r["gflop"] / r["forward_s"],
            r["gflop"] / r["gemm_s"], f"{r['gemm_s'] / r['forward_s']:.0%}",
            f"{one['wall_s'] / r['wall_s']:.2f}x", "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
            f"{r['first_step_s'] * 1e3:.0f} / {r['median_step_s'] * 1e3:.0f} / {r['max_step_s'] * 1e3:.0f}",
            r["graphs_compiled_during_run"],
        ])
    table = bu.markdown_table(
        ["mode", "threads", "run s", "forward s", "GEMM ref s", "forward GFLOP/s", "GEMM GFLOP/s",
         "efficiency", "speed vs 1 thread", "compile s", "first / median / max step ms", "graphs compiled in run"],
        rows)
    r0 = results[0]
    match = (f"greedy outputs of all {len(results)} configurations identical: {identical} "
             f"({len(base)} requests x {len(base[0])} tokens)")
    print()
    print(table)
    print(match)
    if args.write_docs:
        flags = " --quick" if args.quick else ""
        body = "\n".join([
            (f"Command: `PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/forward_efficiency.py{flags} --write-docs` (each configuration "
            "in its own process; the GEMM reference is timed in the same process, at the same thread count, "
            "right after each step of the run)."),
            "",
            f"- Model: {bu.describe_arch(r0['arch'])} (initializer_range {args.init_std}), fp32, CPU.",
            (f"- Workload (throughput_vs_transformers', smaller): {args.num_requests} requests at t=0, prompt "
            f"lengths lognormal (median {args.median_prompt}, capped at {args.max_prompt}; "
            f"{r0['prompt_tokens']} prompt tokens), {args.output_len} output tokens each, greedy, token budget "
            f"{args.token_budget}, max {args.max_num_seqs} sequences; {r0['forwards']} forwards of "
            f"{r0['distinct_widths']} distinct widths; {r0['gflop']:.0f} GFLOP of matmuls in all."),
            "- The machine is shared with 5 other jobs (2 cores): the numbers are indicative, the 2-thread "
            "numbers most of all (a busy second core stalls OpenMP barriers). Load average before each "
            "configuration: " + ", ".join(f"{r['mode']}/{r['threads']}t {r['load_before']}" for r in results)
            + ".",
            "",
            table,
            "",
            f"- {match}.",
        ])
        print("wrote", bu.write_docs_section("forward_efficiency", body))


if __name__ == "__main__":
    main()
