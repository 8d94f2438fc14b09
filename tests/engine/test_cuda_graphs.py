"""The decode-graph machinery (engine/cuda_graphs.py) on the CPU: buckets, static buffers, padding rows
and the fixed launch plan, with the capture replaced by an eager re-run of the same forward on the same
static buffers. The Triton kernels run interpreted (TRITON_INTERPRET=1 in a subprocess), so the plan a
graph would record (split-KV segments decided for the longest context) is what computes here. On a GPU,
tests/engine/test_cuda.py checks the real graphs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from ladle.engine.cuda_graphs import bucket_sizes
from tests.conftest import triton_subprocess_env


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (130, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 130]),
    (600, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, *range(96, 513, 32)]),  # none above MAX_GRAPH_BATCH
])
def test_buckets_cover_every_batch_size(max_num_seqs, expected):
    assert bucket_sizes(max_num_seqs) == expected
    sizes = bucket_sizes(max_num_seqs)
    for n in range(1, min(max_num_seqs, 512) + 1):  # every batch has a bucket, padded by at most 31 rows
        b = min(s for s in sizes if s >= n)
        assert b - n <= (7 if n <= 64 else 31)


EAGER_REPLAY = textwrap.dedent(
    """
    import sys
    import torch
    from ladle.engine import SamplingParams
    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph
    from tests.engine.helpers import make_engine, random_prompt, run_to_completion

    class EagerReplay(DecodeGraphs):
        # "Replay" re-runs the forward a graph records (DecodeGraphs._forward) on the same static buffers
        # and metadata, under inference mode as the real capture.
        @torch.inference_mode()
        def _capture(self, size, pool):
            meta = self._meta(size)
            hidden = self._forward(meta).clone()
            def replay():
                hidden.copy_(self._forward(meta))
            return _Graph(replay, meta, hidden)

    def replay_graphs(eng):
        # What the builder's capture_graphs makes, with EagerReplay for the CUDA capture.
        kv, max_len = eng.kv, eng.config.cache.max_model_len
        graphs = EagerReplay(eng.model, kv.kv_caches, kv.block_size, max_len, eng.config.max_num_seqs, "triton")
        graphs.capture()
        return graphs
    """
)


def _run_script(script: str, *args: str) -> list[str]:
    """Run `script` (after EagerReplay) in a subprocess with the Triton kernels interpreted on the CPU (compiled
    under LADLE_TEST_DEVICE=cuda); its stdout words."""
    proc = subprocess.run([sys.executable, "-c", EAGER_REPLAY + script, *args],
                          env=triton_subprocess_env(), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


SCRIPT = textwrap.dedent(
    """
    path, max_len = sys.argv[1], int(sys.argv[2])
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 17, 90, 5)]
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    eager = make_engine(path, size=32, max_num_seqs=6, max_model_len=max_len, attention_backend="triton",
                        cuda_graphs=False)
    ref = [o.output_token_ids for o in eager.generate(prompts, params)]

    eng = make_engine(path, size=32, max_num_seqs=6, max_model_len=max_len, attention_backend="triton")
    kv = eng.kv
    graphs = replay_graphs(eng)
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
    words = _run_script(SCRIPT, str(tiny_hf_model_dir(family)), str(max_len))
    assert words[0] == "identical"
    assert int(words[1]) > 0  # decode steps went through the graph path
    assert int(words[2]) == segments


COMPILE_SCRIPT = textwrap.dedent(
    """
    from ladle.engine import CacheConfig, EngineConfig, LLMEngine, ModelConfig
    from tests.conftest import TEST_DEVICE

    path, max_len = sys.argv[1], 256
    eng = LLMEngine(EngineConfig(
        model=ModelConfig(path=path, dtype="float32", device=TEST_DEVICE, attention_backend="triton", compile=True),
        cache=CacheConfig(block_size=16, max_model_len=max_len, prefix_caching=False), max_num_seqs=4))
    assert eng.model.compiled
    # On a GPU the builder captured real graphs: of the compiled forward, not the eager fallback.
    real = eng.model_runner.graphs
    assert real is None or real.records_compiled
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 17)]
    params = [SamplingParams(max_tokens=2 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(3)]
    eng.model_runner.graphs = None  # the reference: the compiled forward without graphs
    ref = [o.output_token_ids for o in eng.generate(prompts, params)]
    kv = eng.kv
    before = [c.clone() for c in kv.kv_caches]
    # The capture reuses the start-up's compiled graph: a guard failing on the static buffers would compile
    # the whole forward again (plain tensors where the warm-up traced inference tensors did, before).
    with torch.compiler.set_stance("fail_on_recompile"):
        graphs = replay_graphs(eng)
    assert graphs.records_compiled  # the graphs record the compiled forward
    # The padding slot -1 stored nothing, in any layer (the last one's keys included).
    assert all(torch.equal(a, b) for a, b in zip(before, kv.kv_caches)), "capture wrote into the KV cache"
    eng.model_runner.graphs = graphs
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == ref, (got, ref)
    print("identical", eng.model_runner.graph_steps)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_compiled_model_graphs_store_nothing_for_padding(tiny_hf_model_dir):
    """model.compile with graphs: the graphs record the compiled forward, whose last layer keeps every row
    of a decode step and so writes its keys through the attention backend, which skips slot -1 (every row
    at capture, padding rows at replay). ladle.kernels.reference.write_kv_cache would take -1 as an index (an
    IndexError on a contiguous cache, the last block's last slot on the CPU's)."""
    words = _run_script(COMPILE_SCRIPT, str(tiny_hf_model_dir("qwen3")))
    assert words[0] == "identical"
    assert int(words[1]) > 0


PLAN_SCRIPT = textwrap.dedent(
    """
    path, max_len = sys.argv[1], 512
    prompts = [random_prompt(40, seed=40)]
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)]
    # Chunks of one token whose rows are read (prompt logprobs): every prompt position is a decode-only
    # forward, eager in one engine and replayed from the bucket-1 graph in the other.
    eager = make_engine(path, size=1, max_num_seqs=2, max_model_len=max_len, attention_backend="triton",
                        cuda_graphs=False)
    ref = [o.prompt_logprobs for o in eager.generate(prompts, params)]
    eng = make_engine(path, size=1, max_num_seqs=2, max_model_len=max_len, attention_backend="triton")
    graphs = replay_graphs(eng)
    eng.model_runner.graphs = graphs
    got = [o.prompt_logprobs for o in eng.generate(prompts, params)]
    assert eng.model_runner.graph_steps > 0
    pairs = [(a, b) for r, g in zip(ref, got) for a, b in zip(r, g) if a is not None]
    assert len(pairs) == 39, len(pairs)
    print("compared", len(pairs), max(abs(a - b) for a, b in pairs))
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_replay_equals_eager_to_rounding_past_one_key_tile(tiny_hf_model_dir):
    """A replay sums a context in the capture plan's split-KV segments, eager in its own count (decided
    from the real batch): the same attention in another order, so equal up to fp32 rounding, not bitwise
    (last-bit differences were measured from prompt position ~33 on). fp32 on the CPU, where the
    GEMMs are row-count invariant: what differs is the attention's order alone, and only by rounding."""
    words = _run_script(PLAN_SCRIPT, str(tiny_hf_model_dir("qwen3")))
    assert words[0] == "compared"
    assert float(words[2]) <= 1e-5, f"replayed prompt logprobs differ from eager's by {words[2]}"


def test_staged_inputs_equal_the_metadata_eager_builds():
    """stage derives slots, positions and lengths on the host (numpy) instead of building
    AttentionMetadata: they must be what AttentionMetadata.build gives the same batch, and every padding
    row must store nothing (slot -1) and attend to one key, also after a larger batch used those rows."""
    import torch

    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph
    from ladle.kernels import AttentionMetadata

    block_size, width = 4, 5
    graphs = DecodeGraphs(None, [torch.zeros(1)], block_size, block_size * width, 6)
    replays = []
    for size in graphs.sizes:
        graphs.graphs[size] = _Graph(lambda size=size: replays.append(size), None, torch.zeros(size, 2))
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(40, generator=gen)[:8 * width].view(8, width).to(torch.int32)
    for rows, seq_lens in [([5, 0, 7, 2, 6], [3, 20, 9, 4, 1]), ([1, 3, 4], [17, 8, 12])]:
        n = len(rows)
        ids = [11 * (i + 1) for i in range(n)]
        size = graphs.stage(ids, [s - 1 for s in seq_lens], rows, table)
        hidden = graphs.replay(size, n)
        assert size == graphs.bucket(n)
        assert replays[-1] == size and hidden.shape[0] == n
        meta = AttentionMetadata.build([1] * n, seq_lens, table[rows], block_size)
        assert graphs.slot_mapping[:n].tolist() == meta.slot_mapping.tolist()
        assert graphs.positions[:n].tolist() == meta.positions.tolist()
        assert graphs.input_ids[:n].tolist() == ids
        assert graphs.seq_lens[:n].tolist() == seq_lens
        assert torch.equal(graphs.block_tables[:n], table[rows])
        assert graphs.slot_mapping[n:size].tolist() == [-1] * (size - n)
        assert graphs.seq_lens[n:size].tolist() == [1] * (size - n)
        assert graphs.positions[n:size].tolist() == [0] * (size - n)
        assert int(graphs.block_tables[:size].max()) < 40  # padding rows read block ids in range


def test_staging_guard_is_recorded_on_the_copies_stream(monkeypatch):
    """On CUDA the host staging is rewritten once an event recorded behind the previous replay's
    non-blocking copies has completed. The copies (copy_ into the static buffers) run on the current
    stream of the buffers' device; with model.device cuda:N (N != the current device) that is not
    torch.cuda.current_stream() with no argument, and an event recorded there guards nothing: the next
    replay's numpy writes could race the DMA still reading the staging. Shown with a stand-in event."""
    import torch

    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph

    graphs = DecodeGraphs(None, [torch.zeros(1)], 4, 12, 2)
    for size in graphs.sizes:
        graphs.graphs[size] = _Graph(lambda: None, None, torch.zeros(size, 2))

    class Event:
        recorded_on = "nothing"

        def synchronize(self):
            pass

        def record(self, stream=None):
            self.recorded_on = stream if stream is not None else torch.cuda.current_stream()

    def current_stream(device=None):
        return ("stream of", None if device is None else torch.device(device))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    graphs._copied = event = Event()
    graphs.stage([5], [2], [0], torch.tensor([[1, 0, 0]], dtype=torch.int32))
    assert event.recorded_on == ("stream of", graphs._tokens.device)


MIXED_SCRIPT = textwrap.dedent(
    """
    import math

    path, max_len = sys.argv[1], 256
    prompts = [random_prompt(n, seed=n) for n in (7, 13, 4, 22, 9)]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1, logprobs=1),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2, logprobs=0),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, n=3, prompt_logprobs=2),
    ]

    def run(eng):
        return [(o.output_token_ids, o.prompt_logprobs, o.logprobs, o.top_logprobs, o.prompt_top_logprobs)
                for o in eng.generate(prompts, params)]

    def close(a, b):
        # Floats to 1e-5 relative (with prompt logprobs: their last pieces replay too), all else exactly.
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
        return a == b and type(a) is type(b)

    def engine(graphs=True):
        return make_engine(path, max_num_seqs=4, max_model_len=max_len, attention_backend="triton",
                           num_blocks=10, block_size=4, size=3, ubatch=2, cuda_graphs=graphs)

    ref = run(engine(graphs=False))
    eng = engine()
    graphs = replay_graphs(eng)
    eng.model_runner.graphs = graphs
    preempted, dropped = [0], [0]
    preempt, replay = eng.scheduler._preempt, eng.model_runner._replay

    def counting_preempt(*a):
        preempted[0] += 1
        return preempt(*a)

    def counting_replay(rows, size):
        dropped[0] += sum(k != 0 for k in rows.keep_from)
        return replay(rows, size)

    eng.scheduler._preempt, eng.model_runner._replay = counting_preempt, counting_replay
    got = run(eng)
    assert any(r[1] for r in ref) and any(r[2] for r in ref) and any(r[3] for r in ref) and any(r[4] for r in ref)
    if torch.device(eng.model_runner.device).type == "cuda":
        # A bucket's padded rows may pick another cuBLAS kernel than eager's n rows (engine/cuda_graphs.py),
        # and one-token prompt pieces replay too: the same tokens and top-k ids, logprobs to 1e-5 relative.
        same = [r[0] == g[0] and close(r, g) for r, g in zip(ref, got)]
        assert len(got) == len(ref) and all(same), [(r, g) for r, g, ok in zip(ref, got, same) if not ok][:2]
    else:
        assert got == ref, [(i, a, b) for i, (a, b) in enumerate(zip(ref, got)) if a != b][:2]
    print("identical", eng.model_runner.graph_steps, preempted[0], dropped[0])
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_replays_of_mixed_one_token_forwards_equal_eager(tiny_hf_model_dir):
    """Forwards of 2 tokens (ubatch) over 3-token chunks: one-token pieces that nobody reads (dropped
    after the replay) beside sampling rows and prompt-logprob rows, n-sample forks, and a pool of 10
    blocks of 4 that preempts (recomputed requests get new block lists). max_model_len 256 keeps the
    capture plan's attention order eager's, so tokens, prompt logprobs and logprobs (and their top-k) are bitwise
    equal (on a GPU, where the padded rows may pick other cuBLAS kernels, logprobs to 1e-5 relative)."""
    words = _run_script(MIXED_SCRIPT, str(tiny_hf_model_dir("qwen3")))
    assert words[0] == "identical"
    assert int(words[1]) > 0 and int(words[2]) > 0 and int(words[3]) > 0, words


def test_a_failed_compiled_capture_falls_back_to_the_eager_forward(caplog):
    """The compiled forward's capture is the one path no CPU run exercises for real: if it raises, the graphs
    are captured again from the eager forward (with a warning) instead of failing the engine's start; a
    failure of the eager capture itself still raises."""
    from types import SimpleNamespace

    import torch

    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph

    class Flaky(DecodeGraphs):
        fail_eager = False

        def _capture(self, size, pool):
            if self.records_compiled or self.fail_eager:
                raise RuntimeError("operation not permitted when stream is capturing")
            return _Graph(lambda: None, self._meta(size), torch.zeros(size, 4), None)

    caches = [torch.zeros(2, 4, 16, 1, 8)]
    graphs = Flaky(SimpleNamespace(compiled=True), caches, block_size=16, max_model_len=64, max_num_seqs=4)
    assert graphs.records_compiled
    with caplog.at_level("WARNING", logger="ladle.engine.cuda_graphs"):
        graphs.capture()
    assert not graphs.records_compiled and sorted(graphs.graphs) == [1, 2, 4]
    assert "recording the eager forward instead" in caplog.text and "stream is capturing" in caplog.text

    eager = Flaky(SimpleNamespace(compiled=False), caches, block_size=16, max_model_len=64, max_num_seqs=4)
    eager.fail_eager = True
    with pytest.raises(RuntimeError, match="stream is capturing"):
        eager.capture()


def test_no_garbage_collection_runs_while_capturing():
    """A collection during a capture that destroys a graph left in a reference cycle (another engine's, in
    the same process: a Hydra multirun, a notebook) fails the capture on CUDA ("operation not permitted when
    stream is capturing"); torch >= 2.9 no longer collects before capturing. The captures collect first
    and keep the collector off until they end, restoring it after a failure too. A stand-in capture runs
    an automatic collection where one would happen (gc enabled) and records what was destroyed during it."""
    import gc
    from types import SimpleNamespace

    import torch

    from ladle.engine.cuda_graphs import DecodeGraphs, _Graph

    destroyed_while_capturing = []
    state = SimpleNamespace(capturing=False)

    class GraphInACycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            destroyed_while_capturing.append(state.capturing)

    class Recording(DecodeGraphs):
        fail = False

        def _capture(self, size, pool):
            state.capturing = True
            try:
                if gc.isenabled():
                    gc.collect()  # what an automatic collection at this point of the capture would do
                if self.fail:
                    raise RuntimeError("capture failed")
                return _Graph(lambda: None, self._meta(size), torch.zeros(size, 4), None)
            finally:
                state.capturing = False

    caches = [torch.zeros(2, 4, 16, 1, 8)]
    graphs = Recording(SimpleNamespace(compiled=False), caches, block_size=16, max_model_len=64, max_num_seqs=4)
    assert gc.isenabled()
    gc.disable()  # the cycle stays uncollected until the capture starts
    try:
        GraphInACycle()
    finally:
        gc.enable()
    graphs.capture()
    assert destroyed_while_capturing == [False] and gc.isenabled()

    graphs.fail = True
    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.capture()
    assert gc.isenabled()  # restored after a failed capture
    gc.disable()
    try:
        with pytest.raises(RuntimeError):
            graphs.capture()
        assert not gc.isenabled()  # a collector the caller had turned off stays off
    finally:
        gc.enable()
