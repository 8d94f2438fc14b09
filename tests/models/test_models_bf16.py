"""bf16: ladle's layers do what transformers' do, cast for cast, so with the same attention arithmetic
the logits are bit-identical; with the real attention op they differ only by its rounding."""

from __future__ import annotations

import pytest
import torch

import ladle.models.layers
from ladle.kernels.reference import write_kv_cache
from ladle.models import load_model
from tests.models.ladle_driver import prompt_logits

FAMILIES = ["llama", "qwen3", "gemma3"]


def eager_attention(q, k, v, kv_cache, meta, *, scale, sliding_window=None, softcap=None):
    """transformers' eager attention for one sequence prefilled whole (bf16 scores, fp32 softmax)."""
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.repeat_interleave(group, 1).transpose(0, 1)
    vh = v.repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


@pytest.fixture(scope="module")
def bf16_pairs(tiny_hf_model_dir):
    import transformers

    cache = {}

    def get(name):
        if name not in cache:
            path = tiny_hf_model_dir(name)
            cls = getattr(
                transformers,
                {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[
                    name
                ],
            )
            hf = cls.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
            cache[name] = hf, load_model(str(path), None, torch.bfloat16, "cpu")
        return cache[name]

    return get


def prompt(n: int = 100) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_bit_identical_with_eager_attention(bf16_pairs, monkeypatch, name):
    hf, ours = bf16_pairs(name)
    monkeypatch.setattr(ladle.models.layers, "attention", eager_attention)
    ids = prompt()
    torch.testing.assert_close(prompt_logits(ours, ids), hf_logits(hf, ids), atol=0, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_close_with_the_attention_op(bf16_pairs, name):
    hf, ours = bf16_pairs(name)
    ids = prompt()
    ref, logits = hf_logits(hf, ids), prompt_logits(ours, ids)
    assert (logits - ref).abs().max() < 0.1
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
