"""n samples of one prompt: `SamplingParams(n=k)` against k copies of the same request.

n=k prefills the prompt once and forks its KV. k copies prefill it k times without prefix caching; with
it, a copy admitted after an earlier copy's blocks were registered reuses them (copies admitted in the
same step do not). One random-weight Qwen3-shaped model (fp32, CPU), greedy, `--prompt` tokens,
`--max-tokens` each, chunk 512; the three ways alternate `--repeats` times (order rotating), a fresh
engine each run, reporting prefill tokens (StepStats) and wall time.

    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/n_samples.py
"""

from __future__ import annotations

import argparse
import time

import benchutil as bu
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams

ARCH = bu.qwen3_architecture(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def run(eng: LLMEngine, prompt: list[int], k: int, max_tokens: int, as_n: bool) -> tuple[int, float, list]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if as_n:
        sp.n = k
        eng.add_request(prompt, sp)
    else:
        for _ in range(k):
            eng.add_request(prompt, sp)
    prefill, outs = 0, []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
        prefill += eng.last_step.prefill_tokens if eng.last_step else 0
    return prefill, time.perf_counter() - t0, sorted(o.output_token_ids for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    bu.set_threads(args.threads)
    bu.quiet_random_weights()
    def config(caching: bool) -> EngineConfig:
        return EngineConfig(model=bu.engine_model_config(ARCH),
                            cache=CacheConfig(max_model_len=args.prompt + args.max_tokens + 16, prefix_caching=caching),
                            chunking=ChunkingConfig(size=512), max_num_seqs=max(8, args.k))

    ways = {"n": (True, True), "copies_cached": (False, True), "copies": (False, False)}
    names = {"n": f"n={args.k}", "copies_cached": f"{args.k} copies, prefix caching on",
             "copies": f"{args.k} copies, prefix caching off"}
    prompt = bu.random_prompt(args.prompt, torch.Generator().manual_seed(0), ARCH["vocab_size"])
    times: dict[str, list[float]] = {w: [] for w in ways}
    prefill: dict[str, int] = {}
    outputs: dict[str, list] = {}
    order = list(ways)
    for r in range(args.repeats):
        for way in order[r % 3:] + order[: r % 3]:
            as_n, caching = ways[way]
            eng = LLMEngine(config(caching))  # a fresh engine: a cold prefix cache every run (same seeded weights)
            prefill[way], t, outputs[way] = run(eng, prompt, args.k, args.max_tokens, as_n)
            times[way].append(t)
    assert outputs["n"] == outputs["copies"] == outputs["copies_cached"], "n samples must equal k greedy copies"
    print(f"{bu.describe_arch(ARCH)}; prompt {args.prompt}, k={args.k}, max_tokens {args.max_tokens}, greedy, "
          f"{args.threads} thread(s); median of {args.repeats}")
    print("| way | prefill tokens | wall s (median) | time / n's, per repeat |")
    print("|---|---:|---:|---|")
    for way in ways:
        ratios = ", ".join(f"{t / n:.2f}" for t, n in zip(times[way], times["n"]))
        print(f"| {names[way]} | {prefill[way]} | {bu.median(times[way]):.2f} | {ratios} |")


if __name__ == "__main__":
    main()
