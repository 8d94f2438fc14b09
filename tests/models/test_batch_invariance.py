"""Batch invariance of the model's own ops: with `model.set_deterministic(True)`, a row's hidden
state and logits are bitwise the same alone and among any other rows, at 1 and at 2 threads.

The tracked row is a one-token sequence (its attention sees only itself, so the attention kernel, which
is kernels/' business, adds no reduction of its own); around it, other sequences' prefill chunks and
decodes change the row count of every linear layer, norm and activation, and the row's position.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.kernels import AttentionMetadata, cpu_fused
from ladle.models import load_model
from ladle.models.layers import INVARIANT_ACTIVATIONS, RMSNorm, RotaryEmbedding, apply_rope
from ladle.models.linear import onednn_available
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

pytestmark = [
    pytest.mark.skipif(not onednn_available(), reason="needs torch built with oneDNN"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    # A width no vector loop divides: the fused F.silu would round a row's remainder differently.
    "qwen3_odd": ("Qwen3ForCausalLM", {"intermediate_size": 1000, "hidden_size": 72}),
}
BLOCK = 16


def with_threads(n: int):
    class _Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Threads()


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, (cls, overrides) in ARCHS.items():
        family = name.removesuffix("_odd")
        arch = {"architectures": [cls], **TINY_HF_MODELS[family][1], **overrides, "initializer_range": 0.08}
        model = load_model(None, arch, torch.float32, "cpu", seed=1)
        model.set_deterministic(True)
        out[name] = model
    return out


def run_batch(model, seqs: list[tuple[list[int], int, int]], tracked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of sequences (tokens, context length, first position); returns the tracked sequence's
    last hidden row and its logits, computed among every sequence's last row."""
    per_seq = max(math.ceil((ctx + len(toks)) / BLOCK) for toks, ctx, _ in seqs)
    caches = make_kv_caches(model, per_seq * len(seqs) + 1, BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(seqs))]
    q_lens = [len(toks) for toks, _, _ in seqs]
    meta = AttentionMetadata.build(q_lens, [ctx + q for (_, ctx, _), q in zip(seqs, q_lens)], tables, BLOCK)
    ids = torch.tensor([t for toks, _, _ in seqs for t in toks])
    positions = torch.cat([torch.arange(p, p + len(toks)) for toks, _, p in seqs])
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        last = torch.tensor(q_lens).cumsum(0) - 1
        logits = model.compute_logits(hidden[last])
    return hidden[last[tracked]], logits[tracked]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_rows_logits_do_not_depend_on_the_batch(models, data):
    name = data.draw(st.sampled_from(list(ARCHS)), label="model")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    # The fused CPU kernels (kernels/cpu_fused.py) when they built, and the torch ops they replace.
    fused = data.draw(st.booleans(), label="fused CPU kernels") and cpu_fused.load_library() is not None
    model = models[name]
    vocab = model.arch.vocab_size
    token, position = data.draw(st.integers(3, vocab - 1)), data.draw(st.integers(0, 500))
    others = data.draw(
        st.lists(st.tuples(st.integers(1, 48), st.integers(0, 40), st.integers(0, 2**16)), max_size=6),
        label="others (query len, context, seed)",
    )
    where = data.draw(st.integers(0, len(others)), label="position in the batch")
    seqs = []
    for q, ctx, seed in others:
        toks = torch.randint(3, vocab, (q,), generator=torch.Generator().manual_seed(seed)).tolist()
        seqs.append((toks, ctx, ctx))
    seqs.insert(where, ([token], 0, position))
    before = cpu_fused.enabled()
    cpu_fused.set_enabled(fused)
    try:
        with with_threads(threads):
            alone_hidden, alone_logits = run_batch(model, [([token], 0, position)], 0)
            hidden, logits = run_batch(model, seqs, where)
    finally:
        cpu_fused.set_enabled(before)
    assert torch.equal(hidden, alone_hidden)
    assert torch.equal(logits, alone_logits)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_the_same_bits_at_one_and_two_threads(models, name):
    """Measured here, outside the guarantee (which holds per thread count)."""
    model = models[name]
    seqs = [([5, 9, 11] * 20, 0, 0), ([7], 0, 123), ([8, 8], 30, 30)]
    with with_threads(1):
        one = run_batch(model, seqs, 1)
    with with_threads(2):
        two = run_batch(model, seqs, 1)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_compiled_forward_is_batch_invariant_too():
    """torch.compile: inductor's fused kernels round differently from eager (so compiled != eager, outside
    the guarantee), but one graph serves every row count and its kernels are row-wise: a row's logits
    still do not depend on the batch."""
    cls, overrides = ARCHS["qwen3_odd"]
    arch = {"architectures": [cls], **TINY_HF_MODELS["qwen3"][1], **overrides, "initializer_range": 0.08}
    model = load_model(None, arch, torch.float32, "cpu", seed=1)
    model.set_deterministic(True)
    model.enable_compile()
    gen = torch.Generator().manual_seed(0)
    alone = run_batch(model, [([17], 0, 77)], 0)
    for threads, n_others in [(1, 0), (1, 3), (2, 5), (2, 2), (1, 6)]:
        seqs = [(torch.randint(3, 384, (int(torch.randint(1, 60, (), generator=gen)),), generator=gen).tolist(),
                 0, 0) for _ in range(n_others)]
        seqs.insert(n_others // 2, ([17], 0, 77))
        with with_threads(threads):
            got = run_batch(model, seqs, n_others // 2)
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1]), (threads, n_others)


ROWS = [*range(1, 40), 41, 47, 64, 65, 129, 200, 257, 333]


def rowwise_differences(fn, width: int, threads: int, strided: bool = False) -> list[int]:
    """Row counts at which fn's output for one fixed row differs from its output alone."""
    gen = torch.Generator().manual_seed(width)
    row = torch.randn(width, generator=gen) * 3
    with with_threads(threads):
        alone = fn(row[None])[0]
        bad = []
        for m in ROWS:
            x = torch.randn(m, 2 * width if strided else width, generator=gen) * 3
            pos = int(torch.randint(m, (), generator=gen))
            x[pos, :width] = row
            if not torch.equal(fn(x[:, :width] if strided else x)[pos], alone):
                bad.append(m)
    return bad


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("width", [37, 128, 1000, 2730, 3072])
@pytest.mark.parametrize("act", sorted(INVARIANT_ACTIVATIONS))
def test_invariant_activations(act, width, threads):
    """gate is a strided view of the gate|up matmul output in the MLP; contiguous too."""
    fn = INVARIANT_ACTIVATIONS[act]
    assert rowwise_differences(fn, width, threads, strided=True) == []
    assert rowwise_differences(fn, width, threads) == []


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("width", [16, 64, 1000, 1024, 2730])
@pytest.mark.parametrize("offset", [False, True])
def test_rmsnorm_is_row_wise(offset, width, threads, fused):
    """The torch ops, and the fused CPU kernel (kernels/cpu_fused.py) that runs them by default."""
    if fused and cpu_fused.load_library() is None:
        pytest.skip("no fused CPU kernels")
    norm = RMSNorm(width, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    norm.derive_weights()
    before = cpu_fused.enabled()
    cpu_fused.set_enabled(fused)
    try:
        with torch.inference_mode():
            assert rowwise_differences(norm, width, threads) == []
    finally:
        cpu_fused.set_enabled(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_rope_is_row_wise(threads):
    rope = RotaryEmbedding({"rope_theta": 10000.0, "rope_type": "default"}, 64, 512)

    def rotate(x):  # rows of 6 heads x 64, each at a position of its own content
        positions = (x[:, 0].abs() * 100).long() % 512
        cos, sin = rope(positions, 512, x.dtype)
        return apply_rope(x.view(x.shape[0], 6, 64), cos, sin).flatten(1)

    assert rowwise_differences(rotate, 6 * 64, threads) == []
