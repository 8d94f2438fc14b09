"""The mixed-step graphs (engine/mixed_graphs.py) on the CPU: token buckets, staged inputs against the
metadata eager builds, padded-bucket forwards against the exact forward, the cache left untouched by
padding, the runner's dispatch and fallback, and the memory plan's pool. As in test_cuda_graphs.py the
capture is replaced by an eager re-run of the same forward on the same static buffers, and the Triton
kernels run interpreted (TRITON_INTERPRET=1 in a subprocess) with the launch plan a graph would record."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from ladle.engine import ChunkingConfig, EngineConfig, ModelConfig
from ladle.engine.builder import graph_tokens, mixed_graph_tokens
from ladle.engine.config import CacheConfig, EngineConfigError
from ladle.engine.cuda_graphs import _Graph
from ladle.engine.memory import graph_pool_bytes
from ladle.engine.mixed_graphs import MixedGraphs, token_buckets
from ladle.kernels import AttentionMetadata
from tests.conftest import triton_subprocess_env

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("largest,expected", [
    (5, [5]), (8, [8]), (20, [8, 16, 20]), (64, [8, 16, 32, 64]),
    (512, [8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]),
    (600, [8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 600]),
])
def test_token_buckets_cover_every_count_up_to_the_largest(largest, expected):
    sizes = token_buckets(largest)
    assert sizes == expected
    for n in range(1, largest + 1):  # every count has a bucket; from 64 tokens on, padded by at most a quarter
        b = min(s for s in sizes if s >= n)
        assert n > 64 and b <= 1.25 * n or n <= 64 and b <= max(8, 2 * n)


def _fake_graphs(max_tokens: int, max_num_seqs: int, block_size: int, width: int) -> tuple[MixedGraphs, list]:
    graphs = MixedGraphs(None, [torch.zeros(1)], block_size, block_size * width, max_num_seqs, max_tokens)
    replays: list[int] = []
    for size in graphs.sizes:
        graphs.graphs[size] = _Graph(lambda size=size: replays.append(size), None, torch.zeros(size, 2))
    return graphs, replays


def test_staged_mixed_inputs_equal_the_metadata_eager_builds():
    """stage derives positions and slots with numpy: they must be AttentionMetadata.build's for the same
    batch; padding tokens store nothing (slot -1) at position 0, padding sequences have an empty query
    (query_start_loc repeats the token count) and no keys, also after a larger batch used those rows."""
    block_size, width = 4, 6
    graphs, replays = _fake_graphs(40, 5, block_size, width)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(60, generator=gen)[: 8 * width].view(8, width).to(torch.int32)
    for rows, query_lens, seq_lens in [([5, 0, 7, 2, 6], [1, 9, 1, 13, 3], [6, 20, 1, 13, 24]),
                                       ([3, 1], [7, 1], [11, 23])]:
        n, num_tokens = len(rows), sum(query_lens)
        ids = [3 + i for i in range(num_tokens)]
        size = graphs.stage(ids, query_lens, seq_lens, rows, table)
        hidden = graphs.replay(size, num_tokens)
        assert size == min(s for s in graphs.sizes if s >= num_tokens) and replays[-1] == size
        assert hidden.shape[0] == num_tokens
        meta = AttentionMetadata.build(query_lens, seq_lens, table[rows], block_size)
        assert graphs.slot_mapping[:num_tokens].tolist() == meta.slot_mapping.tolist()
        assert graphs.positions[:num_tokens].tolist() == meta.positions.tolist()
        assert graphs.input_ids[:num_tokens].tolist() == ids
        assert graphs.query_start_loc.tolist() == meta.query_start_loc.tolist() + [num_tokens] * (5 - n)
        assert graphs.seq_lens.tolist() == seq_lens + [0] * (5 - n)
        assert torch.equal(graphs.block_tables[:n], table[rows])
        assert graphs.slot_mapping[num_tokens:size].tolist() == [-1] * (size - num_tokens)
        assert graphs.positions[num_tokens:size].tolist() == [0] * (size - num_tokens)


def test_a_forward_no_graph_holds_is_named_and_refused():
    graphs, _ = _fake_graphs(16, 3, 4, 4)
    table = torch.zeros(4, 4, dtype=torch.int32)
    assert graphs.why_eager(16, 3) is None
    kind, text = graphs.why_eager(17, 2)
    assert kind == "tokens" and "17 tokens" in text and "16 tokens" in text and "model.mixed_graph_tokens" in text
    kind, text = graphs.why_eager(8, 4)
    assert kind == "sequences" and "4 sequences" in text and "max_num_seqs" in text
    with pytest.raises(ValueError, match="17 tokens"):
        graphs.stage([1] * 17, [17], [17], [0], table)


def test_the_memory_plan_counts_the_largest_graph():
    """The graphs' pool is the activations of their largest forward: the mixed-step graphs' (up to the step
    budget, ubatch and model.mixed_graph_tokens) when they are on, else the decode graphs' max_num_seqs."""
    def config(**kw):
        model = {k: kw.pop(k) for k in ("mixed_graph_tokens",) if k in kw}
        return EngineConfig(model=ModelConfig(path="m", **model), cache=CacheConfig(max_model_len=32768),
                            chunking=ChunkingConfig(**kw), max_num_seqs=32)

    assert mixed_graph_tokens(config(size=512)) == 512 and graph_tokens(config(size=512)) == 512
    assert graph_tokens(config(size=512, mixed_graph_tokens=0)) == 32  # decode-only graphs
    assert graph_tokens(config(size=512, ubatch=200)) == 200
    assert graph_tokens(config(size=4096)) == 2048  # the default cap
    assert graph_tokens(config(enabled=False, mixed_graph_tokens=1000)) == 1000
    assert graph_pool_bytes(1000, 512, 512) == 1000
    assert graph_pool_bytes(1000, 512, 32) == 63  # the decode graphs' share, rounded up
    assert graph_pool_bytes(1000, 32800, 2048) == 63


def test_mixed_graph_tokens_is_checked():
    with pytest.raises(EngineConfigError, match="model.mixed_graph_tokens=-1"):
        ModelConfig(path="m", mixed_graph_tokens=-1).validate()


EAGER_REPLAY = textwrap.dedent(
    """
    import logging
    import sys
    import torch
    from ladle.engine import SamplingParams
    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph
    from ladle.engine.mixed_graphs import MixedGraphs
    from ladle.kernels import AttentionMetadata
    from tests.engine.helpers import make_engine, random_prompt

    def eager_replay(cls):
        # "Replay" re-runs the forward a graph records (GraphSet._forward) on the same static buffers and
        # metadata, under inference mode as the real capture.
        class EagerReplay(cls):
            @torch.inference_mode()
            def _capture(self, size, pool):
                meta = self._meta(size)
                hidden = self._forward(meta).clone()
                def replay():
                    hidden.copy_(self._forward(meta))
                return _Graph(replay, meta, hidden)
        return EagerReplay
    """
)


def _run_script(script: str, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", EAGER_REPLAY + script, *args],
                          env=triton_subprocess_env(), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


FORWARD_SCRIPT = textwrap.dedent(
    """
    path, block_size, max_len = sys.argv[1], 4, 128
    eng = make_engine(path, max_num_seqs=6, max_model_len=max_len, block_size=block_size,
                      attention_backend="triton", cuda_graphs=False)
    model, device = eng.model, eng.model_runner.device
    gen = torch.Generator().manual_seed(1)
    # A cache full of keys and values already there: contexts the new tokens attend to.
    start = [torch.randn(c.shape, generator=gen).to(device) for c in eng.kv.kv_caches]
    width = max_len // block_size
    table = torch.zeros(6, width, dtype=torch.int32)  # 8 distinct blocks a row: 32 keys, more than any row has
    table[:, :8] = (torch.randperm(start[0].shape[1] - 1, generator=gen)[:48] + 1).view(6, 8)
    rows = [4, 0, 2, 5]
    query_lens, seq_lens = [1, 7, 1, 9], [20, 30, 5, 9]  # decodes, a chunk after its context, a first chunk
    ids = random_prompt(sum(query_lens), seed=3)
    # The exact forward: eager, every row returned.
    eager_caches = [c.clone() for c in start]
    meta = AttentionMetadata.build(query_lens, seq_lens, table[rows], block_size, device=device, backend="triton")
    meta.restrict_outputs([0] * len(rows))
    with torch.inference_mode():
        exact = model(torch.tensor(ids, device=device), meta.positions, eager_caches, meta)
    # The padded bucket's forward on its own copy of the cache.
    caches = [c.clone() for c in start]
    graphs = eager_replay(MixedGraphs)(model, caches, block_size, max_len, 6, 48, "triton")
    graphs.capture()
    assert all(torch.equal(a, b) for a, b in zip(caches, start)), "capture wrote into the KV cache"
    size = graphs.stage(ids, query_lens, seq_lens, rows, table)
    with torch.inference_mode():  # as the runner replays
        hidden = graphs.replay(size, len(ids))
    # Padding tokens and sequences left the cache as it was: only the batch's slots changed, as eager's did.
    for a, b, c in zip(caches, eager_caches, start):
        written = (b != c).flatten(3).any(-1)  # [2, blocks, block_size]: the slots eager wrote
        assert torch.equal(a[~written], c[~written])
        assert torch.allclose(a[written], b[written], atol=1e-6)
    print("bucket", size, "diff", float((hidden - exact).abs().max()))
    """
)


@needs_triton
def test_padded_bucket_forward_equals_the_exact_forward(tiny_hf_model_dir):
    """18 tokens (two decodes, a chunk after its context, a first chunk) replay the 32-token bucket with 2
    padding sequences: the hidden states are the eager forward's, and the cache changed only at the batch's
    slots."""
    words = _run_script(FORWARD_SCRIPT, str(tiny_hf_model_dir("qwen3")))
    assert words[:2] == ["bucket", "32"], words
    assert float(words[3]) <= 1e-5, f"padded forward differs from the exact one by {words[3]}"


ENGINE_SCRIPT = textwrap.dedent(
    """
    path = sys.argv[1]
    prompts = [random_prompt(n, seed=n) for n in (9, 21, 14, 30)]
    params = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True, n=2 if i == 1 else 1)
              for i in range(4)]

    def engine(graphs):
        # Chunks of 4, 12 tokens a step, 4 sequences: mixed steps of 2 to 12 tokens; 12 blocks of 4 preempt.
        return make_engine(path, max_num_seqs=4, max_model_len=64, block_size=4, num_blocks=12,
                           attention_backend="triton", size=4, token_budget=12, cuda_graphs=graphs)

    def run(eng):
        return [o.output_token_ids for o in eng.generate(prompts, params)]

    ref = run(engine(False))
    eng = engine(True)
    kv, runner = eng.kv, eng.model_runner
    mixed = eager_replay(MixedGraphs)(eng.model, kv.kv_caches, kv.block_size, 64, 4, 6, "triton")
    mixed.capture()
    decode = eager_replay(DecodeGraphs)(eng.model, kv.kv_caches, kv.block_size, 64, 4, "triton")
    decode.capture()
    runner.graphs, runner.mixed_graphs = decode, mixed
    chosen, preempted, lines = [], [0], []
    replay, preempt = mixed.replay, eng.scheduler._preempt

    def recording_replay(size, num_tokens):
        chosen.append((size, num_tokens))
        return replay(size, num_tokens)

    def counting_preempt(*a):
        preempted[0] += 1
        return preempt(*a)

    mixed.replay, eng.scheduler._preempt = recording_replay, counting_preempt
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    logging.getLogger("ladle.engine.model_runner").addHandler(handler)
    logging.getLogger("ladle.engine.model_runner").setLevel(logging.DEBUG)
    got = run(eng)
    assert got == ref, [(i, a, b) for i, (a, b) in enumerate(zip(ref, got)) if a != b][:2]
    again = run(eng)  # from prefix-cached blocks: padding wrote nothing into them
    assert again == ref
    assert eng.num_free_blocks() == eng.num_total_blocks()
    # Dispatch: the smallest bucket that holds the forward's tokens; above the largest (6), eager.
    assert chosen and all(size == min(s for s in mixed.sizes if s >= t) for size, t in chosen), chosen
    assert len({t for _, t in chosen}) > 1, chosen  # forwards of several widths padded to the one bucket
    fallbacks = runner.eager_fallbacks.get("tokens", 0)
    info = [m for level, m in lines if level == logging.INFO]
    assert len(info) == 1 and "above the largest mixed-step graph (6 tokens" in info[0], info
    assert len(lines) == fallbacks
    print("identical", runner.mixed_graph_steps, fallbacks, preempted[0])
    """
)


@needs_triton
def test_engine_outputs_with_mixed_graphs_equal_eager(tiny_hf_model_dir):
    """Greedy tokens with decode and mixed-step graphs equal an eager engine's, with chunked prompts, a
    forked n=2 request, preemption in a pool of 12 blocks and, run again, prefix-cache hits. Forwards of
    more than 6 tokens run eager with one info line (later ones at debug)."""
    words = _run_script(ENGINE_SCRIPT, str(tiny_hf_model_dir("qwen3")))
    assert words[0] == "identical", words
    replayed, fallbacks, preempted = map(int, words[1:])
    assert replayed > 0 and fallbacks > 0 and preempted > 0, words
