"""A job at the scale GPU users run it: max_num_seqs 256, a budget of 8k tokens, thousands of short rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ladle.runner.job import run_job
from tests.runner.conftest import check_run, compose_cfg

ROWS = 3000


def test_thousands_of_rows_at_max_num_seqs_256_are_all_written(tmp_path):
    prompts = [f"row {i}: {'abcdefgh'[: 1 + i % 8]}" for i in range(ROWS)]
    pq.write_table(pa.table({"qid": [f"r{i}" for i in range(ROWS)], "prompt": prompts}), tmp_path / "in.parquet",
                   row_group_size=700)
    cfg = compose_cfg("workload=parquet", f"workload.path={tmp_path / 'in.parquet'}", "workload.id_column=qid",
                      "workload.prompt_column=prompt", "max_num_seqs=256", "cache.max_model_len=64",
                      "chunking.size=8192", "chunking.token_budget=8192", "sampling.max_tokens=3",
                      "sampling.ignore_eos=true", "output.row_group_size=512")
    result = run_job(cfg, tmp_path / "out", engine=None)
    run = check_run(tmp_path / "out", expected_ids=[f"r{i}" for i in range(ROWS)], errors=0)
    assert all(r["output_tokens"] == 3 and r["finish_reason"] == "length" for r in run["rows"])
    assert max(s["running"] for s in run["steps"]) == 256  # the live set reached max_num_seqs
    assert result.summary["errors"] == 0
