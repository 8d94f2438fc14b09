"""The last layer computes only the rows the caller reads (AttentionMetadata.restrict_outputs).

Every layer writes every row's keys and values (later steps read them); the last layer's attention
output, MLP and final norm run only on the kept rows. The kept rows' hidden states must equal the
full forward's rows, and the caches must be left exactly as the full forward leaves them.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from ladle.kernels import AttentionMetadata, set_backend
from ladle.models import load_model
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BLOCK = 16
FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    family = request.param
    arch = {"architectures": [FAMILIES[family]], **TINY_HF_MODELS[family][1], "initializer_range": 0.08}
    return load_model(None, arch, torch.float32, "cpu", seed=3)


# (query length, context length) per sequence: a fresh prefill chunk, a chunk after context, decodes,
# a chunk starting mid-block, and a one-token sequence.
SEQS = [(37, 0), (20, 45), (1, 70), (24, 5), (1, 1), (1, 15)]


def forward(model, keep_from: list[int] | None, backend: str):
    per_seq = max(math.ceil((q + c) / BLOCK) for q, c in SEQS)
    caches = make_kv_caches(model, per_seq * len(SEQS) + 1, BLOCK)
    gen = torch.Generator().manual_seed(0)
    for cache in caches:  # context the chunks attend to, the same for both forwards
        cache.copy_(torch.randn(cache.shape, generator=gen))
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(SEQS))]
    ids = torch.randint(3, model.arch.vocab_size, (sum(q for q, _ in SEQS),), generator=gen)
    with torch.inference_mode():  # as the model runner builds its metadata
        meta = AttentionMetadata.build([q for q, _ in SEQS], [q + c for q, c in SEQS], tables, BLOCK, backend=backend)
        if keep_from is not None:
            meta.restrict_outputs(keep_from)
        hidden = model(ids, meta.positions, caches, meta)
    return hidden, caches, meta


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize(
    "keep_from",
    [
        [36, 19, 0, 23, 0, 0],  # the engine's case: each sequence's last row
        [37, 20, 1, 24, 1, 1],  # nothing kept (every sequence mid-prefill)
        [30, 0, 1, 23, 0, 1],  # longer suffixes (prompt logprobs), some sequences dropped
        [0, 0, 0, 0, 0, 0],  # everything kept: the plain forward
    ],
)
def test_kept_rows_equal_the_full_forward(model, backend, keep_from):
    set_backend(backend)
    try:
        full, full_caches, meta_full = forward(model, None, backend)
        kept, kept_caches, meta = forward(model, keep_from, backend)
    finally:
        set_backend("auto")
    qsl = meta_full.query_start_loc_cpu
    rows = [r for b, first in enumerate(keep_from) for r in range(qsl[b] + first, qsl[b + 1])]
    assert meta.outputs.rows.tolist() == rows
    assert kept.shape == (len(rows), model.arch.hidden_size)
    # Row-wise ops and a batch-invariant linear path: the same bits on the fp32 CPU path; the torch
    # reference's matmuls may round differently for another row count.
    if backend == "cpu_paged":
        assert torch.equal(kept, full[rows])
    else:
        torch.testing.assert_close(kept, full[rows], rtol=1e-5, atol=1e-5)
    for a, b in zip(full_caches, kept_caches, strict=True):  # every row's keys and values are written
        assert torch.equal(a, b)


def test_restrict_outputs_metadata():
    meta = AttentionMetadata.build([4, 1, 3], [10, 7, 3], [[5, 6, 7], [2, 3], [9]], 4)
    out = meta.restrict_outputs([2, 1, 0])
    assert out.rows.tolist() == [2, 3, 5, 6, 7]
    assert not out.every_row and meta.outputs is out
    kept = out.meta
    assert kept.query_start_loc_cpu == [0, 2, 5] and kept.seq_lens_cpu == [10, 3]
    assert kept.block_tables.tolist() == [meta.block_tables[0].tolist(), meta.block_tables[2].tolist()]
    assert kept.positions.tolist() == [8, 9, 0, 1, 2]
    assert kept.slot_mapping.tolist() == meta.slot_mapping[[2, 3, 5, 6, 7]].tolist()
    assert (kept.max_query_len, kept.max_seq_len) == (3, 10)
    every = meta.restrict_outputs([0, 0, 0])
    assert every.every_row and every.meta is meta and every.rows.tolist() == list(range(8))


@pytest.mark.parametrize("keep_from", [[5, 0, 0], [-1, 0, 0], [0, 0]])
def test_restrict_outputs_rejects_bad_offsets(keep_from):
    meta = AttentionMetadata.build([4, 1, 3], [10, 7, 3], [[5, 6, 7], [2, 3], [9]], 4)
    with pytest.raises(ValueError, match="keep_from"):
        meta.restrict_outputs(keep_from)


def test_compiled_forward_keeps_the_same_rows():
    """The compiled graph takes the kept rows as an input of unbacked size: the same rows and caches as
    eager, for a batch that drops rows and for one that keeps them all, from one graph."""
    arch = {"architectures": [FAMILIES["qwen3"]], **TINY_HF_MODELS["qwen3"][1], "initializer_range": 0.08}
    eager = load_model(None, arch, torch.float32, "cpu", seed=3)
    compiled = load_model(None, arch, torch.float32, "cpu", seed=3)
    compiled.enable_compile()
    graphs = counters["stats"]["unique_graphs"]
    for keep_from in ([36, 19, 0, 23, 0, 0], [0, 0, 0, 0, 0, 0], None):
        want, want_caches, _ = forward(eager, keep_from, "cpu_paged")
        got, got_caches, meta = forward(compiled, keep_from, "cpu_paged")
        assert meta.outputs is not None  # the compiled forward always names its rows
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(want_caches, got_caches, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs + 1
