"""Host bookkeeping per decode step: a model so small that a step is almost all engine work.

A 1-layer, hidden-64 Qwen3 (vocab 512, random weights, fp32, CPU, 1 thread) decodes `--batch`
requests at once, each with `--contexts` tokens of context; the median of `--steps` decode-only steps
is reported per phase (StepStats.phase_times: schedule, prepare, forward, sample, update) and in all.
A step whose cost grows with the context (rather than with the batch) shows as a larger total at the
longer context: the forward's attention does grow with context, so the table gives the forward apart.

    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/host_overhead.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import benchutil as bu
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams

PHASES = ["schedule", "prepare", "forward", "sample", "update"]
ARCH = bu.qwen3_architecture(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=512, tie_word_embeddings=True,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258)


def decode_steps(batch: int, context: int, steps: int, output_kind: str = "delta") -> list:
    chunk = 8192
    max_tokens = steps + math.ceil(batch * context / chunk) + 8  # early requests decode while others prefill
    max_len = context + max_tokens + 16
    cfg = EngineConfig(
        model=bu.engine_model_config(ARCH),
        cache=CacheConfig(num_blocks=batch * math.ceil(max_len / 16) + 8, max_model_len=max_len),
        chunking=ChunkingConfig(size=chunk),
        max_num_seqs=batch,
    )
    eng = LLMEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=output_kind)
    for i in range(batch):
        eng.add_request(bu.random_prompt(context, gen, eng.vocab_size), sp, request_id=f"r{i}")
    stats = []
    while len(stats) < steps:
        eng.step()
        s = eng.last_step
        if s.prefill_tokens == 0 and s.decode_tokens == batch:
            stats.append(s)
    return stats[2:]  # the first decode steps warm allocator caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-kinds", nargs="+", default=["delta", "final_only"],
                    help="SamplingParams.output_kind to compare (final_only: the runner's and generate()'s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bu.quiet_random_weights()
    print(f"decode step, batch {args.batch}, 1-layer hidden-64 Qwen3, fp32, CPU, {args.threads} thread(s); "
          f"median of {args.steps - 2} steps, ms")
    print("| context | output_kind | " + " | ".join(PHASES) + " | step | host phases (all but forward) |")
    print("|---:|---|" + "---:|" * (len(PHASES) + 2))
    for ctx in args.contexts:
        for kind in args.output_kinds:  # alternated in one process: the ratio is the number to read
            t0 = time.perf_counter()
            stats = decode_steps(args.batch, ctx, args.steps, kind)
            med = {p: statistics.median(s.phase_times.get(p, 0.0) for s in stats) * 1e3 for p in PHASES}
            step = statistics.median(s.duration for s in stats) * 1e3
            print(f"| {ctx} | {kind} | " + " | ".join(f"{med[p]:.2f}" for p in PHASES)
                  + f" | {step:.2f} | {sum(med[p] for p in PHASES if p != 'forward'):.2f} |"
                  + f"  ({time.perf_counter() - t0:.0f} s)")

if __name__ == "__main__":
    main()
