"""Per-row sampling columns, n samples, logprob columns and scoring, as the runner reads and writes them.

Most tests run on the stand-in engine (tests/runner/fake_engine.py), which honours the new
SamplingParams fields deterministically. The end-to-end tests at the bottom run the real tiny model
(n samples, logprobs, structured output).
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.engine.sampling_params import SamplingParams, StructuredOutputs
from ladle.runner.config import ConfigError, check, to_job_config
from ladle.runner.job import run_job
from ladle.runner.resume import ERRORED, is_done, written_samples
from ladle.runner.sampling import as_int, row_params
from ladle.runner.sinks import TOP_LOGPROB
from tests.runner.conftest import check_run, compose_cfg
from tests.runner.fake_engine import FakeEngine, fake_logprob
from tests.runner.test_job import InterruptAfter

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def write(path, **cols):
    pq.write_table(pa.table(cols), path)
    return path


def rows_of(out):
    return pq.read_table(out / "generations.parquet").to_pylist()


# -- per-row columns ------------------------------------------------------------------------------------


def test_columns_override_the_config_defaults_row_by_row(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["a", "b", "c"],
                temp=pa.array([0.7, None, 0.0]), tp=pa.array([0.9, None, None]), tk=pa.array([5, None, None]),
                sd=pa.array([11.0, None, None]),  # an int column with nulls, as pandas writes it
                st=pa.array([["x", "y"], None, ["z"]]), nn=pa.array([2, None, 1]), mt=pa.array([3, None, 8]),
                schema=pa.array([json.dumps(SCHEMA), None, None]), rx=pa.array([None, "[ab]+", None]),
                ch=pa.array([None, None, ["yes", "no"]]), lp=pa.array([1, None, None]),
                plp=pa.array([None, 0, None]))
    cols = ("{temperature: temp, top_p: tp, top_k: tk, seed: sd, stop: st, n: nn, max_tokens: mt, "
            "json_schema: schema, regex: rx, choice: ch, logprobs: lp, prompt_logprobs: plp}")
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", f"+workload.columns={cols}",
                      "sampling.temperature=0.5", "sampling.seed=100", "sampling.max_tokens=4")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    p = eng.params_seen
    # The job reads finished outputs only: final_only (no per-step outputs or text).
    assert p["0"] == SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=11, stop=["x", "y"],
                                    n=2, logprobs=1, structured=StructuredOutputs(json_schema=SCHEMA),
                                    output_kind="final_only")
    # Row 1: nulls keep the defaults; the config's seed is seed + row index.
    assert p["1"] == SamplingParams(max_tokens=4, temperature=0.5, seed=101, prompt_logprobs=0,
                                    structured=StructuredOutputs(regex="[ab]+"), output_kind="final_only")
    assert p["2"].structured == StructuredOutputs(choice=["yes", "no"]) and p["2"].temperature == 0.0
    rows = rows_of(tmp_path / "out")
    assert sorted((r["id"], r["sample_index"]) for r in rows) == [("0", 0), ("0", 1), ("1", 0), ("2", 0)]
    chosen = next(r for r in rows if r["id"] == "2")
    assert chosen["output_text"] == "yes" and chosen["finish_reason"] == "stop"  # the fake honours choice


@pytest.mark.parametrize("column,value,fragment", [
    ("temperature", float("nan"), "holds nan, which must be a finite number"),
    ("temperature", -1.0, "temperature=-1.0 must be a finite number >= 0"),
    ("seed", 1.5, "holds 1.5, which must be an integer"),
    ("max_tokens", True, "holds True, which must be an integer, not a boolean"),
    ("n", 0, "n=0 must be an integer >= 1"),
    ("logprobs", -1, "logprobs=-1 must be"),
    ("json_schema", '{"type": "object"', "holds '{\"type\": \"object\"', which is not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON schema"),
    ("choice", [], "must be a non-empty list of strings"),
    ("stop", 3, "must be a string or a list of strings"),
    ("top_p", "lots", "holds 'lots', which must be a number"),
])
def test_a_bad_value_is_that_rows_error_naming_column_and_value(tmp_path, column, value, fragment):
    good = {"temperature": 0.5, "seed": 3, "max_tokens": 2, "n": 1, "logprobs": 1, "json_schema": "{}",
            "choice": ["a"], "stop": "zz", "top_p": 0.5}[column]
    src = tmp_path / "p.jsonl"  # JSON keeps each value's own type (a column of one type could not hold them)
    src.write_text("".join(json.dumps({"prompt": p, "v": v}) + "\n"
                           for p, v in [("one", good), ("two", value), ("three", None)]))
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", f"+workload.columns={{{column}: v}}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert rows["1"]["finish_reason"] == "error"
    assert "'v'" in rows["1"]["error"] and fragment in rows["1"]["error"], rows["1"]["error"]
    assert rows["0"]["error"] is None and rows["2"]["error"] is None  # the other rows ran


def test_every_bad_column_of_a_row_is_named_and_two_structured_fields_are_refused(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["x", "y"], t=[float("nan"), 1.0], s=[2.5, 1.0],
                js=[None, "{}"], rx=[None, "a+"])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}",
                      "+workload.columns={temperature: t, seed: s, json_schema: js, regex: rx}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert "column 't'" in rows["0"]["error"] and "column 's'" in rows["0"]["error"]
    assert "json_schema and regex" in rows["1"]["error"]
    assert eng.params_seen == {}


def test_integral_floats_and_strings_are_integers_but_not_fractions():
    assert as_int(1.0) == 1 and as_int("7") == 7
    for bad in (1.5, math.nan, math.inf, True, "1.5", None):
        with pytest.raises(ValueError):
            as_int(bad)
    params, error = row_params(SamplingParams(seed=10), {"seed": 1.0}, {"seed": "column 's'"}, index=5)
    assert error is None and params.seed == 1  # the row's own seed, not seed + index
    params, error = row_params(SamplingParams(seed=10), {"seed": None}, {}, index=5)
    assert error is None and params.seed == 15


def test_jsonl_rows_carry_their_columns(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "a", "k": 3, "schema": SCHEMA}, {"prompt": "b"}, "not json"][:2]) + "\nnot json\n")
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={n: k, json_schema: schema}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    assert eng.params_seen["0"].n == 3 and eng.params_seen["0"].structured.json_schema == SCHEMA
    assert eng.params_seen["1"].n == 1 and eng.params_seen["1"].structured is None
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 3 + 1 + 1 and sum(r["finish_reason"] == "error" for r in rows) == 1


def test_a_jsonl_line_that_is_not_utf8_is_an_error_row(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_bytes(b'{"prompt": "a", "t": 0.5}\n{"prompt": "\xff\xfe"}\n{"prompt": "c"}\n')
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={temperature: t}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert rows["0"]["error"] is None and rows["2"]["error"] is None
    assert "line 2 is not a JSON object" in rows["1"]["error"]


@pytest.mark.parametrize("overrides,fragment", [
    (["+workload.columns={temprature: t}"], "workload.columns.temprature"),
    (["+workload.columns={temperature: nope}"], "workload.columns.temperature='nope' is not a column"),
    (["workload.max_tokens_column=a", "+workload.columns={max_tokens: b}"], "disagree"),
    (["workload=synthetic", "+workload.columns={n: k}"], "workload.kind=synthetic has none"),
    (["sampling.n=0"], "n=0 must be an integer >= 1"),
    (["sampling.logprobs=-2"], "logprobs=-2"),
    (["sampling.max_tokens=0"], "max_tokens=0 is only for scoring"),
    (["sampling.structured.json_schema='{\"type\": '"], "sampling.structured: json_schema="),
    (["sampling.structured.regex=a+", "sampling.structured.choice=[x]"], "sets regex and choice"),
])
def test_config_defaults_are_checked_before_anything_runs(tmp_path, no_model_load, overrides, fragment):
    src = write(tmp_path / "p.parquet", prompt=["a"], a=[1], b=[2], t=[0.5])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", *overrides)
    with pytest.raises(ConfigError) as e:
        run_job(cfg, tmp_path / "out")  # no engine given: a model load would fail the test
    assert fragment in str(e.value), str(e.value)
    assert not (tmp_path / "out" / "generations.parquet").exists()


def test_config_structured_schema_as_mapping_or_text():
    for value in ("{type: object}", "'{\"type\": \"object\"}'"):
        job = to_job_config(compose_cfg(f"sampling.structured.json_schema={value}"))
        check(job)
        from ladle.runner.sampling import base_params

        assert base_params(job.sampling).structured == StructuredOutputs(json_schema={"type": "object"})


def test_a_bad_config_exits_2_with_the_message(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "ladle", "sampling.n=0", f"hydra.run.dir={tmp_path}"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "n=0 must be an integer >= 1" in p.stderr, p.stderr[-2000:]


# -- n samples, logprob columns, scoring ------------------------------------------------------------------


def test_n_samples_are_rows_with_sample_index_and_the_prompt_counts_once(tmp_path):
    prompts = ["hello there", "general kenobi", "x"]
    src = write(tmp_path / "p.parquet", prompt=prompts)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.seed=0",
                      "sampling.temperature=1.0")
    res = run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = rows_of(tmp_path / "out")
    by_id: dict[str, list] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert sorted(by_id) == ["0", "1", "2"]
    for rs in by_id.values():
        assert sorted(r["sample_index"] for r in rs) == [0, 1, 2]
        assert len({r["output_text"] for r in rs}) == 3  # the samples differ
        assert len({r["index"] for r in rs}) == 1
    s = res.summary
    prompt_tokens = sum(len(p.encode()) for p in prompts)
    assert s["requests"] == 3 and s["samples"] == 9 and s["completed"] == 3 and s["errors"] == 0
    assert s["tokens"]["prompt"] == prompt_tokens == s["steps"]["prefill_tokens"]  # prefilled once each
    assert s["tokens"]["output"] == 9 * 4
    assert s["latency_s"]["ttft"]["count"] == 9
    for step in pq.read_table(tmp_path / "out" / "steps.parquet").to_pylist():  # samples share their row's id
        assert sum(step["scheduled_tokens"]) == step["decode_tokens"] + step["prefill_tokens"]
        assert len(set(step["scheduled_ids"])) == len(step["scheduled_ids"])


def test_logprob_columns_have_their_types_and_lengths(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["abc", "hello"], lp=pa.array([None, 0]))
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.logprobs=2",
                      "sampling.prompt_logprobs=1", "+workload.columns={logprobs: lp}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    t = pq.read_table(tmp_path / "out" / "generations.parquet")
    assert t.schema.field("logprobs").type == pa.list_(pa.float32())
    assert t.schema.field("top_logprobs").type == pa.list_(pa.list_(TOP_LOGPROB))
    assert t.schema.field("prompt_logprobs").type == pa.list_(pa.float32())
    assert t.schema.field("sample_index").type == pa.int32()
    rows = {r["id"]: r for r in t.to_pylist()}
    for r in rows.values():
        assert len(r["logprobs"]) == len(r["output_token_ids"]) == r["output_tokens"]
        assert r["logprobs"] == pytest.approx([fake_logprob(x) for x in r["output_token_ids"]])
        assert len(r["prompt_logprobs"]) == len(r["prompt_top_logprobs"]) == r["prompt_tokens"]
        assert r["prompt_logprobs"][0] is None and r["prompt_top_logprobs"][0] == []
        assert all(len(top) == 1 for top in r["prompt_top_logprobs"][1:])
    assert all(len(top) == 2 for top in rows["0"]["top_logprobs"])
    assert all(top == [] for top in rows["1"]["top_logprobs"])  # the row's logprobs=0: no alternatives
    first = rows["0"]["top_logprobs"][0][0]
    assert first["token_id"] == rows["0"]["output_token_ids"][0] and set(first) == {"token_id", "logprob"}


def test_logprob_columns_are_null_when_off(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["abc"])
    run_job(compose_cfg("workload=parquet", f"workload.path={src}"), tmp_path / "out", engine=FakeEngine())
    r = rows_of(tmp_path / "out")[0]
    assert r["sample_index"] == 0
    assert r["logprobs"] is None and r["top_logprobs"] is None and r["prompt_logprobs"] is None
    check_run(tmp_path / "out", expected_ids=["0"])


def test_scoring_gives_prompt_logprobs_and_no_output(tmp_path):
    texts = ["the cat sat", "on the mat"]
    src = write(tmp_path / "p.parquet", prompt=texts)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.max_tokens=0",
                      "sampling.prompt_logprobs=0")
    res = run_job(cfg, tmp_path / "out", engine=FakeEngine())
    for r in rows_of(tmp_path / "out"):
        ids = list(texts[int(r["id"])].encode())
        assert r["output_tokens"] == 0 and r["finish_reason"] == "length" and r["error"] is None
        assert r["prompt_logprobs"][1:] == pytest.approx([fake_logprob(t) for t in ids[1:]])
    assert res.summary["completed"] == 2 and res.summary["tokens"]["output"] == 0


def test_a_request_the_engine_rejects_is_one_error_row_whatever_n(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["ok", "y" * 100])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3")
    out = tmp_path / "out"
    res = run_job(cfg, out, engine=FakeEngine(max_model_len=64))
    rows = rows_of(out)
    bad = [r for r in rows if r["id"] == "1"]
    assert len(bad) == 1 and bad[0]["finish_reason"] == "error" and bad[0]["sample_index"] == 0
    assert len([r for r in rows if r["id"] == "0"]) == 3
    assert (res.summary["requests"], res.summary["completed"], res.summary["errors"]) == (2, 1, 1)
    again = run_job(cfg, out, engine=FakeEngine(max_model_len=64))  # an error row is done, whatever n
    assert again.summary["resumed"] == 2 and len(rows_of(out)) == 4


# -- resume with n ----------------------------------------------------------------------------------------


def test_an_id_is_done_only_when_all_its_samples_are_written():
    assert is_done(0b111, 3) and not is_done(0b101, 3) and not is_done(None, 1) and not is_done(0, 1)
    assert is_done(ERRORED, 5) and is_done(0b111, 2) and is_done(1 << 70 | (1 << 70) - 1, 71)
    assert written_samples(0b101) == {0, 2} and written_samples(ERRORED) == set() and written_samples(None) == set()


def test_interrupted_n_sample_run_resumes_without_duplicates(tmp_path):
    n = 12
    src = write(tmp_path / "p.parquet", prompt=[f"question {i}?" for i in range(n)])
    # choices of different lengths: the samples of a row finish at different steps
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.seed=7",
                      "output.row_group_size=2", "sampling.max_tokens=8", "sampling.structured.choice=[a,bbbbbb,cc]")
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2)
    first = run_job(cfg, out, engine=InterruptAfter(eng, 20))
    assert first.interrupted
    partial = rows_of(out)
    counts: dict[str, int] = {}
    for r in partial:
        counts[r["id"]] = counts.get(r["id"], 0) + 1
    assert any(c < 3 for c in counts.values()), "the interrupt should leave an id with some samples"
    second = run_job(cfg, out, engine=eng)
    rows = rows_of(out)
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * n
    assert second.summary["resumed"] == sum(c == 3 for c in counts.values())
    # A fresh, uninterrupted run gives the same rows (the samples are seeded per (seed + row, sample)).
    fresh = tmp_path / "fresh"
    run_job(cfg, fresh, engine=FakeEngine(max_num_seqs=2))
    want = {(r["id"], r["sample_index"]): r["output_text"] for r in rows_of(fresh)}
    assert {(r["id"], r["sample_index"]): r["output_text"] for r in rows} == want


def test_resume_writes_only_the_missing_samples(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["aa", "bb"])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.seed=1")
    out = tmp_path / "out"
    run_job(cfg, out, engine=FakeEngine())
    path = out / "generations.parquet"
    full = pq.read_table(path)
    keep = [not (r["id"] == "1" and r["sample_index"] == 1) for r in full.to_pylist()]
    pq.write_table(full.filter(pa.array(keep)), path)  # as if sample 1 of row 1 had not been written
    res = run_job(cfg, out, engine=FakeEngine())
    rows = rows_of(out)
    assert len(rows) == 6 and res.summary["resumed"] == 1
    new = [r for r in rows if r["attempt"] == 1]
    assert [(r["id"], r["sample_index"]) for r in new] == [("1", 1)]
    old = {(r["id"], r["sample_index"]): r["output_text"] for r in full.to_pylist()}
    assert new[0]["output_text"] == old[("1", 1)]


def test_a_file_without_sample_index_resumes_as_sample_0(tmp_path):
    src = write(tmp_path / "p.parquet", prompt=["aa", "bb"])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}")
    out = tmp_path / "out"
    run_job(cfg, out, engine=FakeEngine())
    path = out / "generations.parquet"
    old = pq.read_table(path)
    pq.write_table(old.drop_columns(["sample_index", "logprobs", "top_logprobs", "prompt_logprobs",
                                     "prompt_top_logprobs"]).replace_schema_metadata(old.schema.metadata), path)
    res = run_job(cfg, out, engine=FakeEngine())
    assert res.summary["resumed"] == 2 and len(rows_of(out)) == 2


# -- end to end on the real tiny model ---------------------------------------------------------------


def test_json_schema_column_every_output_validates_on_the_tiny_model(tmp_path, engine):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = [SCHEMA, {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                        "additionalProperties": False},
               {"enum": ["red", "green", "blue"]}, None]
    src = write(tmp_path / "p.parquet", prompt=[f"give me item {i}" for i in range(8)],
                schema=pa.array([None if s is None else json.dumps(s) for s in schemas] * 2))
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "+workload.columns={json_schema: schema}",
                      "sampling.max_tokens=48", "sampling.temperature=1.0", "sampling.seed=0")
    run_job(cfg, tmp_path / "out", engine=engine)
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 8
    for r in rows:
        schema = schemas[int(r["id"]) % 4]
        assert r["error"] is None, r["error"]
        if schema is None:
            continue
        if r["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r["output_text"]), schema)
        else:  # cut by max_tokens: what was written is still a prefix the grammar accepts
            assert r["finish_reason"] == "length"
    assert sum(r["finish_reason"] == "stop" for r in rows if schemas[int(r["id"]) % 4] is not None) >= 3


def test_n_samples_on_the_tiny_model_prefill_the_prompt_once(tmp_path, engine):
    prompts = ["The first prompt is here", "A second, longer prompt that takes two chunks of sixteen"]
    src = write(tmp_path / "p.parquet", prompt=prompts)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.seed=0",
                      "sampling.temperature=1.0", "sampling.logprobs=1", "cache.prefix_caching=false")
    res = run_job(cfg, tmp_path / "out", engine=engine)
    rows = rows_of(tmp_path / "out")
    assert sorted((r["id"], r["sample_index"]) for r in rows) == [(i, k) for i in ("0", "1") for k in range(3)]
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and len(r["logprobs"]) == r["output_tokens"]
    s = res.summary
    assert s["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in rows if r["sample_index"] == 0)
    assert s["steps"]["prefill_tokens"] == s["tokens"]["prompt"] - s["tokens"]["cached_prompt"]  # once per row


def test_scoring_on_the_tiny_model_matches_transformers(tmp_path, tiny_hf_model_dir):
    torch = pytest.importorskip("torch")
    from tests.conftest import build_tiny_hf_model

    ids = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    src = write(tmp_path / "p.parquet", prompt=pa.array(ids, pa.list_(pa.int32())))
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", f"model.path={tiny_hf_model_dir('qwen3')}",
                      "model.architecture=null", "model.tokenizer=byte", "model.dtype=float32", "model.device=cpu",
                      "sampling.max_tokens=0", "sampling.prompt_logprobs=0", "chunking.size=4")
    run_job(cfg, tmp_path / "out")
    hf = build_tiny_hf_model("qwen3")
    for r in rows_of(tmp_path / "out"):
        toks = ids[int(r["id"])]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([toks])).logits[0].float(), dim=-1)
        want = [ref[i - 1, toks[i]].item() for i in range(1, len(toks))]
        assert r["output_tokens"] == 0 and r["prompt_logprobs"][0] is None
        assert r["prompt_logprobs"][1:] == pytest.approx(want, abs=1e-4)


def test_resume_keeps_a_good_row_whose_id_repeats_later_as_an_error_row(tmp_path):
    """The repeat's error row is written first (at read time), the good row when it finishes: a resume
    copying rows unique by id alone kept the error row and lost the good one."""
    src = write(tmp_path / "p.parquet", prompt=["first", "second", "third"], key=["x", "y", "x"])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.id_column=key", "sampling.n=2")
    out = tmp_path / "out"
    run_job(cfg, out, engine=FakeEngine())
    before = sorted((r["id"], r["index"], r["sample_index"], r["error"] is None) for r in rows_of(out))
    assert before == [("x", 0, 0, True), ("x", 0, 1, True), ("x", 2, 0, False), ("y", 1, 0, True),
                      ("y", 1, 1, True)]
    res = run_job(cfg, out, engine=FakeEngine())
    assert sorted((r["id"], r["index"], r["sample_index"], r["error"] is None) for r in rows_of(out)) == before
    assert res.summary["resumed"] == 3


# -- vLLM's processing keys as columns --------------------------------------------------------------------


def test_penalty_bias_min_tokens_and_text_columns_reach_the_engine(tmp_path):
    src = tmp_path / "p.jsonl"  # logit_bias as OpenAI writes it: string keys
    src.write_text("".join(json.dumps(o) + "\n" for o in [
        {"prompt": "a", "mt": 3, "pp": 0.5, "fp": -0.25, "rp": 1.2, "lb": {"65": -100, "66": 2.5},
         "inc": True, "skip": "false"},
        {"prompt": "b"},
        {"prompt": "c", "rp": 0.0},
        {"prompt": "d", "lb": {"x": 1}},
    ]))
    cols = ("{min_tokens: mt, presence_penalty: pp, frequency_penalty: fp, repetition_penalty: rp, logit_bias: lb, "
            "include_stop_str_in_output: inc, skip_special_tokens: skip}")
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", f"+workload.columns={cols}",
                      "sampling.max_tokens=4", "sampling.presence_penalty=0.1")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    p = eng.params_seen
    assert p["0"] == SamplingParams(max_tokens=4, temperature=0.0, min_tokens=3, presence_penalty=0.5,
                                    frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={65: -100.0, 66: 2.5},
                                    include_stop_str_in_output=True, skip_special_tokens=False,
                                    output_kind="final_only")
    assert p["1"].presence_penalty == 0.1 and p["1"].logit_bias is None and p["1"].min_tokens == 0
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert "repetition_penalty=0.0 must be a finite number > 0 (1 = off) (from column 'rp')" in rows["2"]["error"]
    assert "column 'lb' (sampling logit_bias)" in rows["3"]["error"]


def test_penalties_from_a_column_give_the_engine_apis_tokens(tmp_path, engine):
    """The real tiny model: a row's penalties and bias make the same output as the engine API with them."""
    from ladle.engine import SamplingParams as SP

    src = write(tmp_path / "p.parquet", prompt=["hello there", "hello there"], rp=pa.array([None, 1.5]),
                lb=pa.array([None, json.dumps({"104": 5.0})]))
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "+workload.columns={repetition_penalty: rp, "
                      "logit_bias: lb}", "sampling.max_tokens=6", "sampling.ignore_eos=true")
    run_job(cfg, tmp_path / "out", engine=engine)
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    prompt = engine.tokenizer.encode("hello there")
    want = engine.generate([prompt, prompt], [
        SP(max_tokens=6, temperature=0.0, ignore_eos=True),
        SP(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, logit_bias={104: 5.0})])
    assert [rows[i]["output_token_ids"] for i in ("0", "1")] == [w.output_token_ids for w in want]
    assert want[0].output_token_ids != want[1].output_token_ids


def test_boolean_and_map_columns_hold_the_flags_and_the_bias(tmp_path):
    """A Parquet bool column for the text switches and a map column for logit_bias (as pandas / Arrow write
    them) are usable column types, not config errors."""
    bias = pa.array([[(65, -5.0)], None], pa.map_(pa.int64(), pa.float64()))
    src = write(tmp_path / "p.parquet", prompt=["a", "b"], inc=pa.array([True, None]), lb=bias)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}",
                      "+workload.columns={include_stop_str_in_output: inc, logit_bias: lb}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    assert eng.params_seen["0"].include_stop_str_in_output is True and eng.params_seen["0"].logit_bias == {65: -5.0}
    assert eng.params_seen["1"].include_stop_str_in_output is False and eng.params_seen["1"].logit_bias is None


def test_a_struct_logit_bias_column_with_other_keys_per_row_leaves_the_missing_ones_out(tmp_path):
    """Arrow writes mappings with different keys as one struct of every key: each row has the keys of
    the others as nulls ({"65": -100} becomes {"65": -100, "66": null}). A null bias is a token the row
    does not bias; before, every such row failed ('must be a number, not a NoneType')."""
    src = write(tmp_path / "p.parquet", prompt=["a", "b"], lb=pa.array([{"65": -100}, {"66": 3}]))
    assert pa.types.is_struct(pq.read_schema(src).field("lb").type)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "+workload.columns={logit_bias: lb}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    assert (eng.params_seen["0"].logit_bias, eng.params_seen["1"].logit_bias) == ({65: -100.0}, {66: 3.0})
    assert all(r["error"] is None for r in rows_of(tmp_path / "out"))
