"""Greedy outputs of the engine equal transformers' generate, chunked or not, on both cache backends."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import GREEDY, hf_greedy, make_engine, random_prompt

FAMILIES = ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"]  # gemma3: sliding window 16, crossing chunk boundaries
CHUNKS = [None, 1, 7, 16, 64]  # None = chunking off


def prompt_lengths(chunk: int | None) -> list[int]:
    if chunk is None:
        return [1, 17, 300]
    return sorted({1, chunk, chunk + 1, 2 * chunk, 300})


@pytest.fixture(scope="module")
def hf_reference():
    """Memoised transformers greedy continuation per (family, prompt length)."""
    models, cache = {}, {}

    def get(family: str, n: int) -> list[int]:
        if (family, n) not in cache:
            if family not in models:
                models[family] = build_tiny_hf_model(family)
            cache[family, n] = hf_greedy(models[family], random_prompt(n, seed=n))
        return cache[family, n]

    return get


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_hf_model_dir, hf_reference, family, chunk, backend):
    chunking = {"enabled": False} if chunk is None else {"size": chunk}
    eng = make_engine(tiny_hf_model_dir(family), backend=backend, **chunking)
    lengths = prompt_lengths(chunk)
    outs = eng.generate([random_prompt(n, seed=n) for n in lengths], GREEDY)
    for n, out in zip(lengths, outs):
        assert out.finish_reason == "length", out.error
        assert out.output_token_ids == hf_reference(family, n), f"prompt of {n} tokens, chunk {chunk}"
    assert eng.num_free_blocks() == eng.num_total_blocks()
