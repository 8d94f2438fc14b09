"""The `ladle::attention` custom op and its forward context (models/attention_op.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from ladle.kernels import AttentionMetadata, attention
from ladle.models.attention_op import attention_context, attention_op

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 16


def _batch(query_lens: list[int], seq_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // BLOCK) for s in seq_lens]
    tables, start = [], 0
    for n in blocks:
        tables.append(list(range(start, start + n)))
        start += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, backend="torch")
    t = sum(query_lens)
    q = torch.randn(t, HEADS, DIM, generator=g)
    k, v = (torch.randn(t, KV_HEADS, DIM, generator=g) for _ in range(2))
    cache = torch.randn(2, start, BLOCK, KV_HEADS, DIM, generator=g)
    return q, k, v, cache, meta


def _expected(q, k, v, cache, meta):
    return attention(q, k, v, cache.clone(), meta, scale=DIM**-0.5)


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (4, 0.0), (-1, 5.0)])  # full, sliding, soft-capped
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_matches_the_real_output(dtype, window, softcap):
    """The fake (what the compiled graph is built for) has the real output's shape, dtype and strides
    (GQA: 4 query heads on 2 KV heads), also for q as the compiled forward passes it: a non-contiguous
    split of the packed q|k heads."""
    q, k, v, cache, meta = _batch([3, 1], [5, 9], seed=0)
    qs, ks = (x.to(dtype) for x in torch.cat((q, k), dim=1).split([HEADS, KV_HEADS], dim=1))
    args = (0, DIM**-0.5, window, softcap)
    with attention_context(meta, [cache.to(dtype)]):
        real = attention_op(qs, ks, v.to(dtype), *args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.ladle.attention(mode.from_tensor(qs), mode.from_tensor(ks), mode.from_tensor(v), *args)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_a_forward_that_raises_leaves_no_context():
    q, k, v, cache, meta = _batch([2], [2], seed=1)
    with pytest.raises(ValueError, match="boom"), attention_context(meta, [cache]):
        raise ValueError("boom")
    with pytest.raises(RuntimeError, match="outside attention_context"):
        attention_op(q, k, v, 0, DIM**-0.5, -1, 0.0)


def test_two_threads_each_see_their_own_context():
    """Two engines stepping in two threads of one process (a server's workers): each forward's op must
    read its own metadata and caches, not those of the forward another thread has entered meanwhile."""
    a = _batch([3, 1], [5, 9], seed=2)
    b = _batch([1, 1, 1], [4, 20, 7], seed=3)
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def run_a():
        q, k, v, cache, meta = a
        try:
            with attention_context(meta, [cache.clone()]):
                a_inside.set()
                assert b_inside.wait(10)  # B has entered its own context
                results["a"] = attention_op(q, k, v, 0, DIM**-0.5, -1, 0.0)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            results["a"] = exc
        finally:
            a_done.set()

    def run_b():
        q, k, v, cache, meta = b
        assert a_inside.wait(10)
        with attention_context(meta, [cache.clone()]):
            b_inside.set()
            assert a_done.wait(10)
            results["b"] = attention_op(q, k, v, 0, DIM**-0.5, -1, 0.0)

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not isinstance(results["a"], Exception), results["a"]
    torch.testing.assert_close(results["a"], _expected(*a))
    torch.testing.assert_close(results["b"], _expected(*b))
