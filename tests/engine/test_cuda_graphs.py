"""The decode-graph machinery (engine/cuda_graphs.py) on the CPU: buckets, static buffers, padding rows
and the fixed launch plan, with the capture replaced by an eager re-run of the same forward on the same
static buffers. The Triton kernels run interpreted (TRITON_INTERPRET=1 in a subprocess), so the plan a
graph would record (split-KV segments decided for the longest context) is what computes here. On a GPU,
tests/engine/test_cuda.py checks the real graphs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.cuda_graphs import bucket_sizes


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (130, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 130]),
])
def test_buckets_cover_every_batch_size(max_num_seqs, expected):
    assert bucket_sizes(max_num_seqs) == expected
    sizes = bucket_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):  # every batch has a bucket, padded by at most 31 rows
        b = min(s for s in sizes if s >= n)
        assert b - n <= (7 if n <= 64 else 31)


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from engine import SamplingParams
    from engine.cuda_graphs import DecodeGraphs, _Graph
    from tests.engine.helpers import make_engine, random_prompt, run_to_completion

    class EagerReplay(DecodeGraphs):
        # "Replay" re-runs the forward on the static buffers and metadata a graph would have recorded.
        def _capture(self, size, pool):
            meta = self._meta(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            hidden = self.model(ids, pos, self.kv_caches, meta).clone()
            def replay():
                hidden.copy_(self.model(ids, pos, self.kv_caches, meta))
            return _Graph(replay, meta, hidden)

    path, max_len = sys.argv[1], int(sys.argv[2])
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 17, 90, 5)]
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    eager = make_engine(path, size=32, max_num_seqs=6, max_model_len=max_len, attention_backend="triton")
    ref = [o.output_token_ids for o in eager.generate(prompts, params)]

    eng = make_engine(path, size=32, max_num_seqs=6, max_model_len=max_len, attention_backend="triton")
    kv = eng.kv
    graphs = EagerReplay(eng.model, kv.kv_caches, kv.block_size, kv.spec.blocks_for(max_len), max_len, 6, "triton")
    graphs.capture()
    # Capture wrote nothing to the cache (every slot was -1).
    assert all(int(c.count_nonzero()) == 0 for c in kv.kv_caches)
    plan = next(iter(graphs.graphs[1].meta.cache.values()))
    eng.model_runner.graphs = graphs
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == ref, (got, ref)
    steps = eng.model_runner.graph_steps
    # Again, from prefix-cached blocks: the padding rows wrote nothing into them.
    again = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert again == ref
    assert eng.num_free_blocks() == eng.num_total_blocks()
    print("identical", steps, plan.num_segments)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("family,max_len,segments", [("qwen3", 512, 2), ("gemma3", 256, 1)])
def test_replayed_decodes_equal_eager(tiny_hf_model_dir, family, max_len, segments):
    """max_model_len 512: a bucket-1 graph plans 2 split-KV segments for every context (empty ones for
    short contexts); 256: too short to split. Both must give eager's tokens."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               LADLE_TEST_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_hf_model_dir(family)), str(max_len)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[0] == "identical"
    assert int(words[1]) > 0  # decode steps went through the graph path
    assert int(words[2]) == segments
