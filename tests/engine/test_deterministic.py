"""Deterministic mode (batch invariance): every request's tokens and logprobs are bitwise those of a reference run
(the request alone, whole prompt, batch of one), whatever the engine configuration and the other requests;
and the combinations that cannot hold it are refused before a model loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle import models
from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.config import EngineConfigError
from ladle.engine.memory import GIB, InsufficientMemory
from tests.engine.test_memory_plan import _config, plan_for

MAX_LEN = 128
FAMILIES = ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"]  # gemma3: sliding-window layers beside full ones


def engine(path, *, deterministic: bool = True, backend: str = "paged", max_num_seqs: int = 1,
           block_size: int = 16, num_blocks: int | None = None, prefix_caching: bool | None = False,
           **chunking) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(path=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(backend=backend, block_size=block_size, num_blocks=num_blocks, max_model_len=MAX_LEN,
                          prefix_caching=prefix_caching),
        chunking=ChunkingConfig(**chunking), max_num_seqs=max_num_seqs, deterministic=deterministic))


Result = dict[tuple[int, int], tuple[list[int], list[float]]]


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> Result:
    outs = eng.generate(prompts, params)
    ids = {rid: i for i, rid in enumerate(dict.fromkeys(o.request_id for o in outs))}
    return {(ids[o.request_id], o.sample_index): (list(o.output_token_ids), list(o.logprobs)) for o in outs}


_references: dict[str, LLMEngine] = {}
_reference_results: dict[tuple, Result] = {}


def reference(name: str, path, prompt: list[int], params: SamplingParams) -> Result:
    """The request alone, prompt prefilled whole, one sequence at a time, no prefix cache."""
    key = (name, tuple(prompt), params.max_tokens, params.seed, params.n)
    if key not in _reference_results:
        if name not in _references:
            _references[name] = engine(path, enabled=False)
        _reference_results[key] = run(_references[name], [prompt], [params])
    return _reference_results[key]


@st.composite
def workloads(draw):
    shared = draw(st.lists(st.integers(3, 383), min_size=0, max_size=40))  # a common prefix: cache hits
    reqs = []
    for _ in range(draw(st.integers(1, 5))):
        own = draw(st.lists(st.integers(3, 383), min_size=1, max_size=30))
        prompt = (shared if draw(st.booleans()) else []) + own
        params = SamplingParams(max_tokens=draw(st.integers(1, 8)), temperature=1.0, seed=draw(st.integers(0, 99)),
                                n=draw(st.sampled_from([1, 1, 2])), logprobs=0, ignore_eos=True)
        reqs.append((prompt, params))
    return reqs


@st.composite
def engine_configs(draw):
    backend = draw(st.sampled_from(["paged", "contiguous"]))
    max_num_seqs = draw(st.integers(1, 6))
    cfg: dict = {"backend": backend, "max_num_seqs": max_num_seqs, "enabled": draw(st.booleans()),
                 "size": draw(st.integers(1, 40)),
                 "token_budget": draw(st.none() | st.integers(max_num_seqs, 64)),
                 "ubatch": draw(st.none() | st.integers(1, 16))}
    if not cfg["enabled"] and cfg["token_budget"] is not None:
        cfg["token_budget"] = MAX_LEN + max_num_seqs
    if backend == "paged":
        cfg["block_size"] = draw(st.sampled_from([4, 16]))
        cfg["prefix_caching"] = draw(st.booleans())
        # A small pool forces preemption (each request needs at most 80 tokens: 70 prompt + 8 output + fork).
        cfg["num_blocks"] = draw(st.none() | st.integers(96 // cfg["block_size"], 200 // cfg["block_size"]))
    else:
        cfg["prefix_caching"] = None
        cfg["num_blocks"] = draw(st.none() | st.integers(1, 3))
    return cfg


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=engine_configs(), work=workloads())
def test_every_request_matches_its_reference_run_bitwise(tiny_hf_model_dir, name, cfg, work):
    path = tiny_hf_model_dir(name)
    prompts, params = [p for p, _ in work], [sp for _, sp in work]
    got = run(engine(path, **cfg), prompts, params)
    for i, (prompt, sp) in enumerate(work):
        want = reference(name, path, prompt, sp)
        for sample in range(sp.n):
            assert got[(i, sample)] == want[(0, sample)], (name, cfg, i, sample)


def test_preemption_prefix_hits_and_forks_in_one_run(tiny_hf_model_dir):
    """One fixed hard case beside the random ones: a pool too small for the batch, shared prefixes, n=2."""
    path = tiny_hf_model_dir("qwen3")
    base = list(range(3, 43))
    work = [(base + [7 + i] * (5 + 3 * i), SamplingParams(max_tokens=8, temperature=1.0, seed=i, n=1 + i % 2,
                                                            logprobs=0, ignore_eos=True)) for i in range(5)]
    eng = engine(path, max_num_seqs=5, block_size=4, num_blocks=20, prefix_caching=True, size=7, ubatch=5)
    preempted, preempt = [], eng.scheduler._preempt
    eng.scheduler._preempt = lambda victim, out: (preempted.append(victim.request_id), preempt(victim, out))
    got = run(eng, [p for p, _ in work], [sp for _, sp in work])
    assert preempted  # the case is what it says
    for i, (prompt, sp) in enumerate(work):
        want = reference("qwen3", path, prompt, sp)
        for sample in range(sp.n):
            assert got[(i, sample)] == want[(0, sample)], (i, sample)


# -- refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, key, fix", [
    ({"device": "cuda"}, "model.device", "model.device=cpu"),
    ({"device": "cuda:1"}, "model.device", "model.device=cpu"),
    ({"dtype": "bfloat16"}, "model.dtype", "model.dtype=float32"),
    ({"dtype": "float16"}, "model.dtype", "model.dtype=float32"),
    ({"attention_backend": "torch"}, "model.attention_backend", "cpu_paged"),
    ({"attention_backend": "triton"}, "model.attention_backend", "cpu_paged"),
    ({"compile": True}, "model.compile", "model.compile=false"),
])
def test_unsupported_combinations_are_refused_by_validate(model, key, fix):
    cfg = EngineConfig(model=ModelConfig(architecture={"x": 1}, **model), deterministic=True)
    with pytest.raises(EngineConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert msg.startswith(key) and "deterministic=true" in msg and fix in msg
    dataclasses.replace(cfg, deterministic=False).validate()  # fine without the switch


def test_cpu_paged_is_a_valid_backend_and_deterministic_accepts_it():
    EngineConfig(model=ModelConfig(architecture={"x": 1}, device="cpu", attention_backend="cpu_paged"),
                 deterministic=True).validate()


def test_an_attention_backend_forced_to_torch_is_refused_before_loading(tiny_hf_model_dir, monkeypatch):
    monkeypatch.setenv("LADLE_ATTENTION_BACKEND", "torch")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(EngineConfigError, match="cpu_paged attention kernel.*LADLE_ATTENTION_BACKEND='torch'"):
        engine(tiny_hf_model_dir("qwen3"))


def test_the_models_refusal_becomes_a_config_error(tiny_hf_model_dir, monkeypatch):
    from ladle.models.model import CausalLM

    def refuse(self, enabled=True):
        raise ValueError("no oneDNN here")

    monkeypatch.setattr(CausalLM, "set_deterministic", refuse)
    with pytest.raises(EngineConfigError, match="no oneDNN here.*deterministic=false"):
        engine(tiny_hf_model_dir("qwen3"))


def test_the_engine_is_deterministic_only_when_asked(tiny_hf_model_dir):
    path = tiny_hf_model_dir("llama")
    assert engine(path).model_runner.model.deterministic is True
    assert engine(path).model_runner.attention_backend == "cpu_paged"
    assert getattr(engine(path, deterministic=False).model_runner.model, "deterministic", False) is False


def test_the_packed_copies_are_not_dropped_in_deterministic_mode():
    """Where the packed linear copies do not fit, the plan drops them (slower, same outputs) - but
    deterministic mode needs them: it refuses with the numbers instead."""
    tight = {"available_bytes": int(17.5 * GIB)}
    assert plan_for(_config(), 4, **tight)[0].packed_weight_bytes == 0
    with pytest.raises(InsufficientMemory, match=r"deterministic=true needs the linear layers' packed copies "
                                                 r"\(\d+\.\d+ GiB\).*17\.5 GiB of available host memory"):
        plan_for(dataclasses.replace(_config(), deterministic=True), 4, **tight)
    assert plan_for(dataclasses.replace(_config(), deterministic=True), 4,
                    available_bytes=64 * GIB)[0].packed_weight_bytes > 10 * GIB


def test_runner_passes_the_switch():
    from ladle.runner.config import engine_config, to_job_config
    from tests.runner.conftest import compose_cfg

    assert engine_config(to_job_config(compose_cfg("deterministic=true"))).deterministic is True
    assert engine_config(to_job_config(compose_cfg())).deterministic is False


def test_unseeded_requests_draw_their_own_stream_in_deterministic_mode():
    """Without a seed a request drew from the engine's shared generator, consumed in batch order: the
    headline sweep (`deterministic=true sampling.temperature=1`, no seed) changed tokens at position 0.
    Each unseeded request now draws from a seed derived from the engine's and its id."""
    import yaml as _yaml

    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from tests.engine.helpers import drive
    from tests.engine.helpers import random_prompt as _prompt

    tiny = _yaml.safe_load((Path(__file__).parents[2] / "ladle" / "conf" / "model" / "tiny.yaml").read_text())
    prompts = [_prompt(5 + 7 * i, seed=i, vocab=256) for i in range(6)]

    def tokens(size: int, order: list[int]) -> dict[str, list[int]]:
        eng = LLMEngine(EngineConfig(model=ModelConfig(**tiny, device="cpu", dtype="float32"),
                                     cache=CacheConfig(max_model_len=128), chunking=ChunkingConfig(size=size),
                                     deterministic=True))
        for i in order:
            eng.add_request(prompts[i], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
                            request_id=f"r{i}")
        return {rid: list(o.output_token_ids) for rid, o in drive(eng).finished.items()}

    assert tokens(4, [0, 1, 2, 3, 4, 5]) == tokens(64, [5, 3, 1, 0, 2, 4])
