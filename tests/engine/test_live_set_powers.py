"""The live set grows and shrinks across every power of two up to 256, and no request notices.

The persistent block table doubles its rows (64 -> 128 -> 256) and hands released rows back; CUDA graphs
are captured per batch-size bucket (powers of two). A step that crosses one of these sizes, either way,
must compute every sequence exactly as if it ran alone. On the CPU the engine runs in deterministic mode,
so seeded sampled tokens are compared bitwise; on CUDA (no deterministic mode) greedy tokens are compared.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.engine.helpers import drive, random_prompt, wrap_execute

POWERS = [2**i for i in range(9)]  # 1 .. 256
MAX_TOKENS = 10
SEEDS = 2
PROMPTS = [random_prompt(4 + (7 * i) % 29, seed=500 + i) for i in range(8)]
DETERMINISTIC = TEST_DEVICE == "cpu"


def engine(path, max_num_seqs: int, **kw) -> LLMEngine:
    cache = {k: kw.pop(k) for k in ("block_size", "prefix_caching") if k in kw}
    return LLMEngine(EngineConfig(
        model=ModelConfig(path=str(path), dtype="float32", device=TEST_DEVICE),
        cache=CacheConfig(max_model_len=64, **cache), chunking=ChunkingConfig(**kw),
        max_num_seqs=max_num_seqs, deterministic=DETERMINISTIC))


def params(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if DETERMINISTIC else 0.0, seed=seed,
                          ignore_eos=True)


_alone: dict[tuple[int, int], list[int]] = {}
_alone_engine: list[LLMEngine] = []


def alone(path, prompt: int, seed: int) -> list[int]:
    """The request run by itself (batch of one, prompt whole, no prefix cache), MAX_TOKENS long: a request
    with fewer max_tokens has its prefix (ignore_eos; the seeded draws come in order)."""
    if (prompt, seed) not in _alone:
        if not _alone_engine:
            _alone_engine.append(engine(path, 1, enabled=False, prefix_caching=False))
        out = _alone_engine[0].generate([PROMPTS[prompt]], params(seed, MAX_TOKENS))[0]
        _alone[(prompt, seed)] = list(out.output_token_ids)
    return _alone[(prompt, seed)]


class LiveSetPath:
    """Adds requests after each step so the live set (sequences in the forward) follows `targets`: up
    through each power of two, then, with no more arrivals, down as requests finish."""

    def __init__(self, targets: list[int], requests: list[tuple[int, int, int]]) -> None:
        self.targets, self.requests = targets, requests  # requests: (prompt, seed, max_tokens), used in turn
        self.k, self.added, self.live = 0, {}, [0]  # live: sequences in each forward, in order

    def watch(self, eng: LLMEngine) -> None:
        def measure(execute, scheduled):
            out = execute(scheduled)
            self.live.append(len(eng.model_runner.block_table))
            return out
        wrap_execute(eng, measure)

    def after_step(self, eng: LLMEngine) -> None:
        if self.k < len(self.targets) and self.live[-1] >= self.targets[self.k]:
            self.k += 1  # reached: on to the next size
        if self.k < len(self.targets):
            want = self.targets[self.k] - eng.scheduler.num_running - eng.scheduler.num_waiting
            for _ in range(max(want, 0)):
                prompt, seed, max_tokens = self.requests[len(self.added) % len(self.requests)]
                rid = eng.add_request(PROMPTS[prompt], params(seed, max_tokens))
                self.added[rid] = (prompt, seed, max_tokens)


@st.composite
def setups(draw):
    requests = draw(st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, SEEDS - 1),
                                       st.integers(1, MAX_TOKENS)), min_size=16, max_size=64))
    chunking = draw(st.sampled_from([{"size": 8192, "token_budget": 8192}, {"size": 256, "token_budget": 1024},
                                     {"size": 16, "token_budget": 512}]))
    return requests, {**chunking, "block_size": draw(st.sampled_from([4, 16])),
                      "prefix_caching": draw(st.booleans())}


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],  # no
          # shrinking: an example runs hundreds of requests, and a failing one is reported as drawn
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setup=setups())
def test_each_request_equals_its_run_alone_as_the_live_set_crosses_powers_of_two(tiny_hf_model_dir, setup):
    path = tiny_hf_model_dir("qwen3")
    requests, cfg = setup
    eng = engine(path, 256, **cfg)
    walk = LiveSetPath(POWERS, requests)
    walk.watch(eng)
    walk.after_step(eng)
    run = drive(eng, walk.after_step)
    walk.live.append(len(eng.model_runner.block_table))  # idle: every row given back
    for p in POWERS:  # every size is crossed going up and coming down
        assert any(a < p <= b for a, b in zip(walk.live, walk.live[1:])), (p, walk.live)
        assert any(b < p <= a for a, b in zip(walk.live, walk.live[1:])), (p, walk.live)
    assert len(run.finished) == len(walk.added)
    for rid, (prompt, seed, max_tokens) in walk.added.items():
        want = alone(path, prompt, seed)[:max_tokens]
        steps = [t for o in run.of(rid) for t in o.new_token_ids]  # every step's output, in order
        assert steps == want == run.finished[rid].output_token_ids, (rid, prompt, seed)
        assert run.finished[rid].finish_reason == "length"
