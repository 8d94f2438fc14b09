"""What the engine tests share: build an engine over a tiny HF model directory; transformers' greedy oracle."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.detokenizer import Detokenizer
from ladle.engine.request import RequestOutput, StepStats
from tests.conftest import TEST_DEVICE

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_engine(
    path,
    *,
    backend: str = "paged",
    max_model_len: int = 512,
    num_blocks: int | None = None,
    block_size: int = 16,
    prefix_caching: bool | None = None,
    max_num_seqs: int = 8,
    clock=None,
    attention_backend: str = "auto",
    device: str | None = None,
    cuda_graphs: bool = True,
    **chunking,
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32", device=device or TEST_DEVICE,
                              attention_backend=attention_backend, cuda_graphs=cuda_graphs),
            cache=CacheConfig(
                backend=backend,
                block_size=block_size,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                prefix_caching=prefix_caching,
            ),
            chunking=ChunkingConfig(**chunking),
            max_num_seqs=max_num_seqs,
        ),
        clock=clock,
    )


def random_prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int = 32) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # like ignore_eos: no stopping and no EOS masking
        )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


@dataclass
class Drive:
    """What an engine did from now until idle."""

    outputs: list[RequestOutput] = field(default_factory=list)  # every output of every step, in order
    finished: dict[str, RequestOutput] = field(default_factory=dict)  # request id -> its final output
    samples: dict[tuple[str, int], RequestOutput] = field(default_factory=dict)  # (id, sample) -> final
    steps: list[StepStats] = field(default_factory=list)  # each step's StepStats (last_step), in order

    def of(self, request_id: str) -> list[RequestOutput]:
        """Every output of one request, in order."""
        return [o for o in self.outputs if o.request_id == request_id]


def drive(eng: LLMEngine, after_step: Callable[[LLMEngine], None] | None = None,
          max_steps: int = 100_000) -> Drive:
    """Step until idle, calling after_step(eng) after each step; check_engine after every step and every
    after_step; then check that every request finished and no KV block leaked."""
    run = Drive()
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            run.outputs.append(out)
            if out.finished:
                run.finished[out.request_id] = out
                run.samples[(out.request_id, out.sample_index)] = out
        if eng.last_step is not None:
            run.steps.append(eng.last_step)
        check_engine(eng)
        if after_step is not None:
            after_step(eng)
            check_engine(eng)
    assert not eng.has_unfinished_requests(), "engine did not finish"
    assert eng.num_free_blocks() == eng.num_total_blocks(), "KV blocks leaked"
    check_engine(eng)
    return run


def check_engine(eng: LLMEngine) -> None:
    """The engine's rules between steps: a waiting request (new, preempted, a deferred sample) holds no KV
    block; every block's reference count is the number of running sequences holding it (none leaked,
    none shared without a reference); the block pool's own invariants."""
    sched = eng.scheduler
    for req in sched.waiting:
        assert not req.block_ids and req.num_cached_blocks == 0, (
            f"waiting request {req.seq_key} holds KV blocks {req.block_ids}")
    held = [0] * eng.kv.num_blocks
    for req in sched.running:
        for b in req.block_ids:
            held[b] += 1
    refs = eng.kv.pool.ref_counts
    wrong = [(b, refs[b], held[b]) for b in range(len(held)) if refs[b] != held[b]]
    assert not wrong, f"blocks whose reference count is not their running holders (block, refs, held): {wrong[:5]}"
    eng.kv.pool.check_invariants()


def run_to_completion(eng: LLMEngine, max_steps: int = 100_000) -> dict[str, RequestOutput]:
    """Step until idle; {request_id: final RequestOutput} (drive's checks included)."""
    return drive(eng, max_steps=max_steps).finished


def wrap_execute(eng: LLMEngine, around: Callable[[Callable, Any], Any]) -> None:
    """Route the model runner's execute(scheduled) through around(execute, scheduled). The patch holds the
    runner weakly: a closure over its bound method, stored on it, would keep the engine (its KV cache, its
    CUDA graphs) in a reference cycle until a garbage collection, which may fall inside another engine's
    graph capture (engine/cuda_graphs.py)."""
    runner, execute = weakref.ref(eng.model_runner), type(eng.model_runner).execute

    def call(scheduled):
        return execute(runner(), scheduled)

    eng.model_runner.execute = lambda scheduled: around(call, scheduled)


def fail_on_forward(eng: LLMEngine, n: int | None, message: str = "injected failure") -> None:
    """Make the n-th call of the model runner raise (1-based); None injects nothing."""
    calls = {"n": 0}

    def flaky(execute, scheduled):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError(message)
        return execute(scheduled)

    wrap_execute(eng, flaky)


def use_tokenizer(eng: LLMEngine, tok, eos_token_ids: set[int] | None = None) -> None:
    """Swap the engine's tokenizer on both sides (prompts in, text out) and its EOS ids (none by default)."""
    eng.input_processor.tokenizer = tok
    eng.output_processor.detokenizer = Detokenizer(tok)
    eng.output_processor.eos_token_ids = set() if eos_token_ids is None else eos_token_ids
