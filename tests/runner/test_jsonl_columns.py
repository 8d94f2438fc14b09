"""JSONL columns are checked over the lines, not the first line alone.

A column is present when any line has it (a config error, exit 2, when none does: checked when the
source opens, before the model loads); a line without a column has a null there: a null prompt or trace
time makes that row an error row, a null sampling value keeps the config's default.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.job import run_job
from ladle.runner.sources import open_source
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine


def jsonl(path, *lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_a_key_missing_from_the_first_line_but_present_later_is_a_column(tmp_path):
    """It was a config error: only line 1's keys counted."""
    src = jsonl(tmp_path / "p.jsonl", {"prompt": "a"}, {"prompt": "b", "t": 0.7}, {"q": "no prompt", "t": 0.2})
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={temperature: t}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    assert eng.params_seen["0"].temperature == 0.0 and eng.params_seen["1"].temperature == 0.7  # default, own
    assert rows["0"]["error"] is None and rows["1"]["error"] is None
    assert "prompt is null (column 'prompt')" in rows["2"]["error"]  # a required column missing: its row only


def test_a_column_no_line_has_is_a_config_error_even_when_line_1_is_not_json(tmp_path, no_model_load):
    """Line 1 not being JSON skipped the check: every row became an error row after the model loaded."""
    src = jsonl(tmp_path / "p.jsonl", "{not json", {"question": "a"}, {"question": "b"})
    with pytest.raises(ConfigError, match=r"workload.prompt_column='prompt' is not a column of any line of .*"
                                          r"p.jsonl; its columns are: question"):
        run_job(compose_cfg("workload=jsonl", f"workload.path={src}"), tmp_path / "out")
    ok = open_source(WorkloadConfig(kind="jsonl", path=str(src), prompt_column="question"))
    assert [r.prompt for b in ok.batches() for r in b] == [None, "a", "b"]


def test_columns_are_found_in_any_file_of_a_directory_and_the_scan_stops_once_all_are_seen(tmp_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    jsonl(d / "a.jsonl", {"prompt": "a"}, *[{"prompt": f"x{i}"} for i in range(50)])
    jsonl(d / "b.jsonl", {"prompt": "b", "k": "id-b"}, *[{"prompt": f"y{i}", "k": f"y{i}"} for i in range(50)])
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda raw, *a, **kw: parsed.append(raw) or real(raw, *a, **kw))
    src = open_source(WorkloadConfig(kind="jsonl", path=str(d), id_column="k"))
    assert len(parsed) <= 2, "only lines that may hold a missing column's key are parsed, up to the first hit"
    assert src.total == 102


def test_a_key_only_inside_a_value_does_not_count_as_a_column(tmp_path):
    src = jsonl(tmp_path / "p.jsonl", {"prompt": "say \"t\": 1"}, {"prompt": "x", "other": {"t": 2}})
    with pytest.raises(ConfigError, match="workload.columns.temperature='t' is not a column of any line"):
        open_source(WorkloadConfig(kind="jsonl", path=str(src), columns={"temperature": "t"}))


def test_an_escaped_key_counts(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a", "\\u0074": 0.5}\n')  # the key "t", written with an escape
    open_source(WorkloadConfig(kind="jsonl", path=str(src), columns={"temperature": "t"}))
