"""The per-layer op budget of a decode forward, counted with models/op_count.py (eager, fp32, CPU).

Budgets are ceilings at today's counts (compute ops; views counted apart): a change that adds ops to
a layer fails here and must say why. Before fusion (separate q/k/v and gate/up matmuls, norm then
residual add, seven-op RoPE) the same counts were Llama 48, Qwen3 60, Gemma 3 78.
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import AttentionMetadata
from ladle.models import load_model
from ladle.models.op_count import MATMUL_OPS, count_layer_ops, decode_ops_per_layer
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
BUDGET = {"llama": 28, "qwen3": 34, "gemma3": 46}  # the aim: 25, 25, 35 (not yet reached)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def models():
    return {
        name: load_model(None, {"architectures": [cls], **TINY_HF_MODELS[name][1]}, torch.float32, "cpu")
        for name, cls in ARCHS.items()
    }


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("context_lens", [[10], [40, 35, 33]], ids=["one-seq", "ragged-batch"])
def test_decode_ops_per_layer_within_budget(models, name, context_lens):
    model = models[name]
    counts = decode_ops_per_layer(model, context_lens)
    # Unequal spans (one power-of-two bucket here) mask the padded keys: three more ops in SDPA.
    extra = 0 if len(set(context_lens)) == 1 else 3
    assert counts["compute"] <= BUDGET[name] + extra, counts


@pytest.mark.parametrize("name", list(ARCHS))
def test_each_layer_runs_four_matmuls(models, name):
    """Packed projections: qkv, o, gate_up, down (seven before packing); the last layer projects q apart
    from k|v (its queries only for the rows the caller reads)."""
    model = models[name]
    caches = make_kv_caches(model, 3, 16)
    meta = AttentionMetadata.build([1, 1], [13, 8], [[1], [2]], 16)
    counter, scopes = count_layer_ops(model, torch.tensor([5, 6]), torch.tensor([12, 7]), caches, meta)
    for scope in scopes:
        counts = counter.counts[scope]
        assert sum(counts[op] for op in MATMUL_OPS) == (5 if scope == scopes[-1] else 4), (scope, dict(counts))
