"""Offline throughput: ladle vs transformers' continuous batching (`model.generate_batch`).

A random-weight model with the Qwen3-0.6B architecture (conf/model/qwen3_0_6b.yaml) is built with
transformers' Qwen3Config + Qwen3ForCausalLM from a fixed seed and saved with save_pretrained to a temp
directory; both systems load that directory, in the same dtype, on the CPU. The same prompts (all at
t=0, lognormal lengths) run through

- ladle: LLMEngine.generate, greedy (temperature 0), ignore_eos, chunking.token_budget = --token-budget
  and chunking.size = --token-budget (a prompt may take the whole budget, as in transformers);
- transformers: model.generate_batch with attn_implementation "paged|sdpa", GenerationConfig(
  max_new_tokens, do_sample=False, eos disabled), ContinuousBatchingConfig(scheduler_type="fifo",
  allow_block_sharing=False, max_batch_tokens=--token-budget, max_requests_per_batch=--max-num-seqs,
  num_blocks sized to the same KV capacity as ladle's),

alternating in one run (--repeats rounds; the order flips every round). Reported: output tokens/s and
total (prompt + output) tokens/s of each (median over rounds), the per-round ratio ladle/transformers
(median), and a token-for-token comparison of the greedy outputs (identical requests, and where the
others first diverge: random-weight models have near-ties in their logits, so a late divergence after
an identical prefix is a rounding tie, not a bug).

    .venv/bin/python benchmarks/throughput_vs_transformers.py --quick
    .venv/bin/python benchmarks/throughput_vs_transformers.py --num-requests 32 --max-prompt 512 --output-len 32
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import benchutil as bu
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_random_model(arch: dict, dtype: str, seed: int, directory: Path, init_std: float | None = None) -> None:
    """Qwen3ForCausalLM with transformers' own random initialisation (seeded), saved in `dtype`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    keys = {k: v for k, v in arch.items() if k not in ("torch_dtype", "architectures", "model_type")}
    if init_std is not None:
        keys["initializer_range"] = init_std
    config = Qwen3Config(**keys)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(_DTYPES[dtype]).eval()
    model.save_pretrained(directory)
    del model


def make_prompts(n: int, median_len: int, sigma: float, max_len: int, min_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [min(max_len, max(min_len, round(rng.lognormvariate(math.log(median_len), sigma)))) for _ in range(n)]
    return [bu.random_prompt(length, gen, vocab) for length in lengths]


class Ladle:
    name = "ladle"

    def __init__(self, path: Path, args, kv_tokens: int, max_model_len: int):
        cfg = EngineConfig(
            model=ModelConfig(name="qwen3_0_6b-random", path=str(path), tokenizer="byte", dtype=args.dtype,
                              device=args.device),
            cache=CacheConfig(block_size=16, num_blocks=math.ceil(kv_tokens / 16), max_model_len=max_model_len,
                              prefix_caching=False),
            chunking=ChunkingConfig(size=args.token_budget, token_budget=args.token_budget),
            max_num_seqs=args.max_num_seqs,
        )
        self.engine = LLMEngine(cfg)
        self._summary = ""

    def summary(self) -> str:
        """Seconds of the last run's steps that carried prefill tokens vs decode-only steps, and phases."""
        return self._summary

    def run(self, prompts: list[list[int]], output_len: int, stats: bool = False) -> list[list[int]]:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        eng = self.engine
        if not stats:
            return self._check(eng.generate(prompts, sp))
        # The loop of LLMEngine.generate, reading each step's StepStats on the way.
        ids = [eng.add_request(p, sp) for p in prompts]
        done = {}
        mixed = decode = 0.0
        n_mixed = n_decode = 0
        phases: dict[str, float] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
            s = eng.last_step
            if s is None:
                continue
            if s.prefill_tokens:
                mixed += s.duration
                n_mixed += 1
            else:
                decode += s.duration
                n_decode += 1
            for k, v in s.phase_times.items():
                phases[k] = phases.get(k, 0.0) + v
        self._summary = (f"{n_mixed} steps with prefill {mixed:.1f}s, {n_decode} decode-only steps {decode:.1f}s; "
                         + ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
        return self._check([done[i] for i in ids])

    @staticmethod
    def _check(outs) -> list[list[int]]:
        bad = [o.error for o in outs if o.finish_reason != "length"]
        if bad:
            raise RuntimeError(f"ladle: {len(bad)} requests did not finish by length: {bad[:2]}")
        return [o.output_token_ids for o in outs]


class Transformers:
    name = "transformers"

    def __init__(self, path: Path, args, kv_tokens: int, max_model_len: int):
        from transformers import Qwen3ForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "paged|" prefix deprecation notice
            self.model = Qwen3ForCausalLM.from_pretrained(
                str(path), dtype=_DTYPES[args.dtype], attn_implementation=args.hf_attn
            ).eval().to(args.device)
        self.args = args
        self.kv_tokens = kv_tokens
        self.max_model_len = max_model_len

    def run(self, prompts: list[list[int]], output_len: int, stats: bool = False) -> list[list[int]]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        a = self.args
        gen_cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
        # The page-size keyword was renamed across transformers 5.x (block_size -> page_size), and
        # max_blocks_per_request is newer: pass what this version takes.
        accepted = inspect.signature(ContinuousBatchingConfig.__init__).parameters
        options = {
            "scheduler_type": "fifo",
            "allow_block_sharing": False,
            "max_batch_tokens": a.token_budget,
            "max_requests_per_batch": a.max_num_seqs,
            "num_blocks": math.ceil(self.kv_tokens / a.hf_page_size),
            "max_blocks_per_request": 0,  # the flash fast-decode path does not exist on CPU
        }
        options["page_size" if "page_size" in accepted else "block_size"] = a.hf_page_size
        cb_cfg = ContinuousBatchingConfig(**{k: v for k, v in options.items() if k in accepted})
        # persistent_manager: the manager (and its KV cache, allocated and zero-filled when it is made) is
        # built by the warm-up call and reused, as ladle's engine is; allocation is not timed for either.
        out = self.model.generate_batch(
            prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg, progress_bar=False,
            persistent_manager=True,
        )
        by_index = {int(rid.rsplit("_", 1)[1]): o for rid, o in out.items()}
        first = min(by_index)
        result = []
        for i in range(len(prompts)):
            o = by_index[first + i]
            if list(o.prompt_ids) != list(prompts[i]):
                raise RuntimeError(f"transformers: output req_{first + i} does not belong to prompt {i}")
            if o.error:
                raise RuntimeError(f"transformers: request {i} failed: {o.error}")
            result.append(list(o.generated_tokens))
        return result


def profile_run(system, prompts: list[list[int]], output_len: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    # transformers steps in a background thread: record every thread.
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        system.run(prompts, output_len, stats=True)
    wall = time.perf_counter() - t
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages) / 1e6
    rows = [[e.key, e.self_cpu_time_total / 1e6, f"{100 * e.self_cpu_time_total / 1e6 / total:.1f}%", e.count]
            for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]]
    print(f"\nprofile of {system.name} (one run, {wall:.1f}s wall under the profiler, {total:.1f}s of op time):")
    print(bu.markdown_table(["op", "self s", "share", "calls"], rows))
    if isinstance(system, Ladle):
        print(f"ladle steps: {system.summary()}")


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    identical = 0
    firsts = []
    for x, y in zip(a, b):
        if x == y:
            identical += 1
            continue
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        firsts.append(n)
    distinct = [len(set(x)) for x in a]
    return {"identical": identical, "first_divergence": sorted(firsts), "distinct_tokens": bu.median(distinct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 short requests, 16 output tokens (< 2 min)")
    ap.add_argument("--write-docs", action="store_true", help="write the report to benchmarks/results/")
    ap.add_argument("--num-requests", type=int, default=None, help="default 128 (quick 6)")
    ap.add_argument("--median-prompt", type=int, default=None, help="lognormal median, default 256 (quick 48)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of prompt lengths")
    ap.add_argument("--max-prompt", type=int, default=None, help="cap, default 2048 (quick 128)")
    ap.add_argument("--min-prompt", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=None, help="tokens generated per request, default 128 "
                    "(quick 8)")
    ap.add_argument("--token-budget", type=int, default=512,
                    help="tokens per step: ladle chunking.token_budget (and chunking.size) = transformers "
                         "max_batch_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="ladle max_num_seqs = transformers max_requests_per_batch")
    ap.add_argument("--kv-gib", type=float, default=3.0, help="cap on each system's KV cache")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both systems)")
    ap.add_argument("--hf-attn", default="paged|sdpa", help="transformers attn_implementation")
    ap.add_argument("--hf-page-size", type=int, default=256, help="transformers page size (its default)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of (ladle, transformers); default 2 "
                    "(quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None, help="reuse/keep the saved random model here")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, run each system once more under torch.profiler and print "
                         "its top ops (self CPU time, all threads)")
    ap.add_argument("--init-std", type=float, default=0.1,
                    help="initializer_range of the random model. The config's 0.02 gives outputs of ~3 "
                         "distinct tokens (a near-constant model, so token identity proves little); 0.1 gives "
                         "varied outputs. Timing does not depend on it")
    args = ap.parse_args()
    q = args.quick
    args.num_requests = args.num_requests or (6 if q else 128)
    args.median_prompt = args.median_prompt or (48 if q else 256)
    args.max_prompt = args.max_prompt or (128 if q else 2048)
    args.output_len = args.output_len or (8 if q else 128)
    args.repeats = args.repeats or (1 if q else 2)
    threads = bu.set_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    arch = bu.preset_architecture("qwen3_0_6b")
    prompts = make_prompts(args.num_requests, args.median_prompt, args.sigma, args.max_prompt, args.min_prompt,
                           arch["vocab_size"], args.seed)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = args.output_len * len(prompts)
    max_model_len = max(len(p) for p in prompts) + args.output_len
    bytes_per_token = (2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * arch["head_dim"]
                       * torch.tensor([], dtype=_DTYPES[args.dtype]).element_size())
    need = sum(math.ceil((len(p) + args.output_len) / 256) * 256 for p in prompts)
    kv_tokens = min(need, int(args.kv_gib * 2**30 // bytes_per_token))
    kv_tokens = max(kv_tokens, math.ceil(max_model_len / 256) * 256)
    print(f"model: {bu.describe_arch(arch)}, {args.dtype}, torch threads {threads}")
    lengths = sorted(len(p) for p in prompts)
    print(f"workload: {len(prompts)} requests, prompt tokens {prompt_tokens} (min {lengths[0]}, median "
          f"{lengths[len(lengths) // 2]}, max {lengths[-1]}), {args.output_len} output tokens each; token budget "
          f"{args.token_budget}, max seqs {args.max_num_seqs}, KV capacity {kv_tokens} tokens each "
          f"({kv_tokens * bytes_per_token / 2**30:.2f} GiB)")

    tmp = None
    if args.model_dir:
        path = Path(args.model_dir)
    else:
        tmp = tempfile.mkdtemp(prefix="ladle-bench-")
        path = Path(tmp)
    try:
        if not (path / "config.json").is_file():
            t = time.perf_counter()
            save_random_model(arch, args.dtype, args.seed, path, args.init_std)
            print(f"saved random model to {path} in {time.perf_counter() - t:.1f}s")
        systems = [Ladle(path, args, kv_tokens, max_model_len), Transformers(path, args, kv_tokens, max_model_len)]
        # Warm up both (first-call allocations, kernel selection) on two short prompts.
        for s in systems:
            s.run([p[:16] for p in prompts[:2]], 2)
        times: dict[str, list[float]] = {s.name: [] for s in systems}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            for s in systems if r % 2 == 0 else systems[::-1]:
                t = time.perf_counter()
                out = s.run(prompts, args.output_len)
                dt = time.perf_counter() - t
                times[s.name].append(dt)
                outputs.setdefault(s.name, out)
                if out != outputs[s.name]:
                    print(f"  note: {s.name} outputs changed between rounds")
                print(f"  round {r + 1}/{args.repeats} {s.name:>12}: {dt:.1f}s, {output_tokens / dt:.2f} output "
                      f"tok/s, {(prompt_tokens + output_tokens) / dt:.1f} total tok/s", flush=True)
        if args.profile:
            for s in systems:
                profile_run(s, prompts, args.output_len)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    cmp = compare(outputs["ladle"], outputs["transformers"])
    ratios = [h / lad for lad, h in zip(times["ladle"], times["transformers"])]
    rows = []
    for name in ("ladle", "transformers"):
        t = bu.median(times[name])
        rows.append([name, t, output_tokens / t, (prompt_tokens + output_tokens) / t,
                     f"{bu.median(ratios):.2f}x" if name == "ladle" else "1.00x"])
    table = bu.markdown_table(["system", "seconds", "output tok/s", "total tok/s", "speed vs transformers"], rows)
    firsts = cmp["first_divergence"]
    div = (f"the other {len(firsts)} first diverge at output positions {firsts}" if firsts else "no divergence")
    match = (f"greedy outputs identical for {cmp['identical']}/{len(prompts)} requests ({div}); median distinct "
             f"tokens per output: {cmp['distinct_tokens']:g} of {args.output_len}")
    speedup = bu.median(ratios)
    verdict = ("target (ladle >= 2x transformers with identical greedy outputs) "
               + ("met" if speedup >= 2 and cmp["identical"] == len(prompts) else "not met")
               + f": {speedup:.2f}x, {cmp['identical']}/{len(prompts)} identical")
    print()
    print(table)
    print(match)
    print(verdict)
    if args.write_docs:
        flags = "" if q else (f" --num-requests {args.num_requests} --median-prompt {args.median_prompt} "
                              f"--max-prompt {args.max_prompt} --output-len {args.output_len} "
                              f"--repeats {args.repeats}")
        cmd = f".venv/bin/python benchmarks/throughput_vs_transformers.py{' --quick' if q else ''}{flags} --write-docs"
        body = "\n".join([
            f"Command: `{cmd}`",
            "",
            (f"- Model: {bu.describe_arch(arch)} (conf/model/qwen3_0_6b.yaml's architecture; transformers' "
            f"Qwen3ForCausalLM init with initializer_range {args.init_std}, seed {args.seed}, saved with "
            f"save_pretrained and loaded by both), "
            f"{args.dtype}, CPU, torch threads {threads}."),
            (f"- Workload: {len(prompts)} requests at t=0, prompt lengths lognormal (median {args.median_prompt}, "
            f"sigma {args.sigma}, capped at {args.max_prompt}; here min {lengths[0]}, median "
            f"{lengths[len(lengths) // 2]}, max {lengths[-1]}, {prompt_tokens} in all), {args.output_len} output "
            f"tokens each, greedy, EOS ignored."),
            (f"- Both: {args.token_budget} tokens per step (ladle chunking.token_budget = chunking.size; "
            f"transformers max_batch_tokens), at most {args.max_num_seqs} requests per step, KV capacity "
            f"{kv_tokens} tokens each. transformers: attn_implementation {args.hf_attn!r}, fifo scheduler, "
            f"block sharing off, page size {args.hf_page_size}, its manager kept between calls "
            f"(persistent_manager=True, built by a warm-up call) so that, as for ladle's engine, allocating the "
            f"KV cache is not timed. ladle: paged cache (block 16), prefix caching off."),
            (f"- {args.repeats} round(s), order flipped every round; medians; the speed ratio is the median of "
            "per-round ratios."),
            "",
            table,
            "",
            f"- {match}.",
            f"- **{verdict}.**",
        ])
        print("wrote", bu.write_docs_section("throughput_vs_transformers",
                                             body))


if __name__ == "__main__":
    main()
