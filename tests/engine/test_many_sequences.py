"""The engine at the scale GPU users run: hundreds of live sequences, budgets of thousands of tokens.

The persistent block table starts with 64 rows and doubles when more sequences are live; every step
that crosses 64, 128, ... live sequences must read the grown table, not the one it replaced.
"""

from __future__ import annotations

from ladle.engine import SamplingParams
from ladle.engine.block_table import PersistentBlockTable
from tests.engine.helpers import drive, make_engine, random_prompt, run_to_completion

GREEDY4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _distinct_prompts(n: int) -> list[list[int]]:
    return [random_prompt(8 + i % 13, seed=1000 + i) for i in range(n)]


def _reference(path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Outputs from a small batch (at most 8 live sequences: the table never grows)."""
    outs = make_engine(path, max_num_seqs=8, max_model_len=128, size=64).generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.output_token_ids for o in outs]


def test_gather_reads_the_table_after_it_grew():
    t = PersistentBlockTable(max_blocks_per_seq=4, rows=2)
    ids = [f"r{i}" for i in range(5)]
    rows = t.gather(ids, [[i + 10] for i in range(5)])  # grows twice: 2 -> 4 -> 8 rows
    assert rows[:, 0].tolist() == [10, 11, 12, 13, 14]
    assert t.table.shape[0] == 8


def test_200_prompts_admitted_in_one_step_all_finish(tiny_hf_model_dir):
    """200 prompts of 100 tokens fit one 8k-token step with max_num_seqs=200: the step that brings the
    65th (and 129th) sequence live must not fail, and outputs equal a small batch's."""
    path = tiny_hf_model_dir("llama")
    prompts = [random_prompt(100, seed=i) for i in range(200)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng = make_engine(path, max_num_seqs=200, max_model_len=128, size=8192, token_budget=8192)
    ids = [eng.add_request(p, params) for p in prompts]
    done = run_to_completion(eng)
    assert [done[i].finish_reason for i in ids] == ["length"] * 200
    ref = _reference(path, prompts[::25], params)
    assert [done[i].output_token_ids for i in ids[::25]] == ref


def test_thousands_of_requests_at_max_num_seqs_256(tiny_hf_model_dir):
    """2,000 requests, 256 live at once, a 16k-token budget (prefix caching on: repeated prompts hit)."""
    path = tiny_hf_model_dir("qwen3")
    distinct = _distinct_prompts(40)
    prompts = [distinct[i % len(distinct)] for i in range(2000)]
    eng = make_engine(path, max_num_seqs=256, max_model_len=64, size=16384, token_budget=16384)
    ids = [eng.add_request(p, GREEDY4) for p in prompts]
    live = []  # requests in the block table after each step
    done = drive(eng, after_step=lambda e: live.append(len(e.model_runner.block_table))).finished
    assert max(live) == 256
    assert [o.finish_reason for o in done.values()].count("length") == 2000
    ref = _reference(path, distinct, GREEDY4)
    assert [done[i].output_token_ids for i in ids] == [ref[i % len(distinct)] for i in range(2000)]
