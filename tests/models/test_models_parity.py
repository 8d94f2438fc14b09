"""ladle's models against transformers on tiny random checkpoints: logits at every prompt position and
32-token greedy continuations, for prompts of 1, 17 and 300 tokens (past the sliding windows, and into
Phi's long RoPE factors)."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import AttentionMetadata
from ladle.models import load_model
from tests.conftest import TEST_DEVICE, build_tiny_hf_model
from tests.models.ladle_driver import Sequence, greedy, make_kv_caches, prompt_logits

FAMILIES = ["llama", "llama_tied", "qwen3", "gemma3", "gemma3_softcap", "qwen2", "mistral", "phi3", "qwen3_moe",
            "mixtral"]
NEW_TOKENS = 32

pytestmark = pytest.mark.filterwarnings("ignore:Gemma 3 ignores attn_logit_softcapping")


def make_prompt(length: int, seed: int, vocab: int = 384) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def pair(request, tiny_hf_model_dir):
    cache = {}

    def get(name):
        if name not in cache:
            hf = build_tiny_hf_model(name)
            ours = load_model(str(tiny_hf_model_dir(name)), None, torch.float32, TEST_DEVICE)
            cache[name] = (hf, ours)
        return cache[name]

    return get


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    logits = hf(ids).logits[0].float()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return logits, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("length", [1, 17, 300])
def test_logits_and_greedy_match_transformers(pair, name, length):
    hf, ours = pair(name)
    prompt = make_prompt(length, seed=length)
    ref_logits, ref_tokens = hf_greedy(hf, prompt, NEW_TOKENS)
    logits, tokens = greedy(ours, prompt, NEW_TOKENS)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    if len(ref_tokens) < NEW_TOKENS:  # transformers stopped at EOS; ladle's driver does not
        assert ref_tokens[-1] in ours.arch.eos_token_ids
    assert tokens[: len(ref_tokens)] == ref_tokens


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_matches_transformers(pair, name, chunk):
    hf, ours = pair(name)
    prompt = make_prompt(150, seed=chunk)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(ours, prompt, chunk=chunk), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen2", "phi3", "qwen3_moe", "mixtral"])
def test_mixed_batch_matches_transformers(pair, name):
    """Prefill chunks and decodes of three sequences in one flattened forward, like an engine step."""
    hf, ours = pair(name)
    prompts = [make_prompt(n, seed=n) for n in (50, 30, 5)]
    with torch.inference_mode():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    block_size = 16
    pool = make_kv_caches(ours, 12, block_size)
    tables = [[7, 2, 9, 4], [0, 11, 5], [3, 8]]
    seqs = [Sequence(ours, 64, block_size, pool, table) for table in tables]
    # Before the step: sequences 1 and 2 have everything but their last prompt token cached.
    for s, p in zip(seqs[1:], prompts[1:]):
        s.feed(p[:-1])
    # The step: sequence 0 prefills its first 32 tokens, 1 and 2 feed one token each (decodes).
    pieces = [prompts[0][:32], prompts[1][-1:], prompts[2][-1:]]
    ids = torch.tensor([t for piece in pieces for t in piece], device=TEST_DEVICE)
    positions = torch.cat([torch.arange(s.length, s.length + len(p)) for s, p in zip(seqs, pieces)]).to(TEST_DEVICE)
    meta = AttentionMetadata.build(
        [len(p) for p in pieces], [s.length + len(p) for s, p in zip(seqs, pieces)], tables, block_size,
        device=TEST_DEVICE,
    )
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, positions, pool, meta)).cpu()
    torch.testing.assert_close(logits[:32], refs[0][:32], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[32], refs[1][-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[33], refs[2][-1], atol=1e-4, rtol=1e-4)
