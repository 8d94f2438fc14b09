"""The step's host work is O(batch) + O(new tokens): a persistent block table, no prompt+output rebuilds."""

from __future__ import annotations

import pytest

from ladle.engine.block_table import PersistentBlockTable
from ladle.engine.request import Request
from ladle.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion


def test_block_table_rows_follow_extensions_new_lists_and_releases():
    t = PersistentBlockTable(max_blocks_per_seq=8, rows=1)
    a, b = [3, 4], [7]
    assert t.rows(["a", "b"], [a, b]) == [0, 1]  # grew past its one row
    assert t.table[0, :2].tolist() == [3, 4] and t.table[1, :1].tolist() == [7]
    a.append(9)  # a decode crossed into a new block: only the new id is written
    t.table[0, 0] = -1  # a stale entry the table must not rewrite for an extension
    t.rows(["a"], [a])
    assert t.table[0, :3].tolist() == [-1, 4, 9]
    a = [5]  # preempted and readmitted: a new list is rewritten from its start
    t.rows(["a"], [a])
    assert t.table[0, 0].item() == 5
    t.release("a")
    assert t.rows(["c"], [[6, 6]]) == [0] and len(t) == 2  # the released row is reused


def test_a_step_never_rebuilds_prompt_plus_output(tiny_hf_model_dir, monkeypatch):
    """Decoding reads tokens by slices; `all_token_ids` (O(context) per request per step) is not used."""
    path = tiny_hf_model_dir("qwen3")
    ref = make_engine(path, size=8).generate([random_prompt(30, seed=2)], SamplingParams(max_tokens=12,
                                                                                           ignore_eos=True))

    def forbidden(self):
        raise AssertionError("prompt + output rebuilt in a step")

    monkeypatch.setattr(Request, "all_token_ids", property(forbidden))
    eng = make_engine(path, size=8)
    rid = eng.add_request(random_prompt(30, seed=2), SamplingParams(max_tokens=12, ignore_eos=True))
    assert run_to_completion(eng)[rid].output_token_ids == ref[0].output_token_ids


@pytest.mark.parametrize("num_blocks", [6, 40])
def test_preempted_requests_get_their_new_blocks_in_the_table(tiny_hf_model_dir, num_blocks):
    """A tight cache preempts and readmits with other blocks; outputs equal a roomy cache's."""
    path = tiny_hf_model_dir("llama")
    prompts = [random_prompt(n, seed=n) for n in (20, 33, 17)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = make_engine(path, size=8).generate(prompts, params)
    eng = make_engine(path, size=8, num_blocks=num_blocks, max_model_len=96)
    ids = [eng.add_request(p, params) for p in prompts]
    done = run_to_completion(eng)
    if num_blocks == 6:
        assert sum(done[i].metrics.num_preemptions for i in ids) > 0
    assert [done[i].output_token_ids for i in ids] == [r.output_token_ids for r in ref]
    assert len(eng.model_runner.block_table) == 0  # every finished request gave its row back


def test_token_slice_matches_the_concatenation():
    req = Request("r", [1, 2, 3], SamplingParams(), metrics=None)  # type: ignore[arg-type]
    req.output_token_ids.extend([4, 5])
    whole = [1, 2, 3, 4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_slice(start, end) == whole[start:end]
