"""The sources (runner/sources/): reading every kind, and the checks of paths, columns and traces before the model loads.

Sources stream rows in source order, in batches, with the mapped columns; prompts encode or explain why not.

What a source checks when it opens, before the model loads: every file's columns (arrow), empty column
names, the prompt's and a trace's column types, and a trace's order.
"""

from __future__ import annotations

import datetime
import decimal
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import (
    ArrivalConfig,
    ConfigError,
    SyntheticConfig,
    SyntheticGroup,
    WorkloadConfig,
    check,
    to_job_config,
)
from ladle.runner.prompts import encode_prompt
from ladle.runner.sources import open_source
from tests.runner.conftest import PROMPTS, compose_cfg
from tests.runner.fake_engine import ByteTokenizer


def rows(cfg: WorkloadConfig, vocab: int | None = None):
    src = open_source(cfg)
    src.vocab_size = vocab
    batches = list(src.batches())
    return src, batches, [r for b in batches for r in b]


@pytest.mark.parametrize(("kind", "path"), [
    ("parquet", "prompts.parquet"), ("parquet", "parts"), ("arrow", "prompts.arrow"), ("hf_dataset", "hf"),
    ("hf_dataset", "prompts.jsonl"), ("jsonl", "prompts.jsonl"),
])
def test_every_kind_reads_the_same_rows(kind, path, datasets_dir):
    cfg = WorkloadConfig(kind=kind, path=str(datasets_dir / path), prompt_column="question", id_column="qid",
                         max_tokens_column="max_tokens", batch_size=3)
    src, batches, got = rows(cfg)
    assert [r.prompt for r in got] == PROMPTS
    assert [r.id for r in got] == [f"q{i}" for i in range(8)]
    assert [r.index for r in got] == list(range(8))
    assert [r.max_tokens for r in got] == [None, 2, None, 3, None, None, 1, None]
    assert all(len(b) <= 3 for b in batches)  # streamed in batches of workload.batch_size
    assert src.total in (8, None)


def test_limit_and_row_index_ids(datasets_dir):
    cfg = WorkloadConfig(kind="parquet", path=str(datasets_dir / "prompts.parquet"), prompt_column="tokens",
                         limit=5, batch_size=2)
    src, _, got = rows(cfg)
    assert src.total == 5 and [r.id for r in got] == ["0", "1", "2", "3", "4"]
    assert got[0].prompt == list(PROMPTS[0].encode())


def test_trace_column_is_read(datasets_dir):
    cfg = WorkloadConfig(kind="jsonl", path=str(datasets_dir / "prompts.jsonl"), prompt_column="messages")
    cfg.arrivals.process, cfg.arrivals.column = "trace", "arrival_ms"
    _, _, got = rows(cfg)
    assert [r.arrival for r in got][:4] == [0.0, 5.0, 5.0, 40.0]
    assert got[0].prompt[1] == {"role": "user", "content": PROMPTS[0]}


def test_large_parquet_streams_in_batches(tmp_path):
    n = 20000
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)]}), tmp_path / "big.parquet", row_group_size=1000)
    src = open_source(WorkloadConfig(kind="parquet", path=str(tmp_path / "big.parquet"), batch_size=128))
    it = src.batches()
    first = next(it)
    assert len(first) == 128 and first[0].prompt == "p0"
    assert sum(len(b) for b in it) == n - 128


def test_jsonl_bad_lines_become_row_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"prompt": "a"}\n\nnot json\n[1, 2]\n{"other": 1}\n')
    _, _, got = rows(WorkloadConfig(kind="jsonl", path=str(p)))
    assert [r.index for r in got] == [0, 1, 2, 3]
    assert got[0].prompt == "a" and got[0].error is None
    assert "line 3" in got[1].error and "line 4" in got[2].error
    assert got[3].prompt is None and got[3].error is None  # missing key: a null prompt


def test_missing_column_and_path_are_config_errors(datasets_dir, tmp_path):
    with pytest.raises(ConfigError, match="'nope' is not a column.*question"):
        open_source(WorkloadConfig(kind="arrow", path=str(datasets_dir / "prompts.arrow"), prompt_column="nope"))
    with pytest.raises(ConfigError, match="id_column"):
        open_source(WorkloadConfig(kind="hf_dataset", path=str(datasets_dir / "hf"), prompt_column="question",
                                   id_column="uid"))
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(WorkloadConfig(kind="jsonl", path=str(tmp_path / "none.jsonl")))
    with pytest.raises(ConfigError, match="no .arrow"):
        open_source(WorkloadConfig(kind="arrow", path=str(tmp_path)))


def test_synthetic_is_seeded_and_shaped():
    groups = [SyntheticGroup(name="a", num_requests=20, prompt_len=50, prompt_len_sigma=0.5, min_prompt_len=10,
                             max_prompt_len=80, shared_prefix_len=16, max_tokens=8, max_tokens_sigma=0.3),
              SyntheticGroup(name="b", num_requests=5, prompt_len=7)]
    cfg = WorkloadConfig(kind="synthetic", synthetic=SyntheticConfig(groups=groups, seed=1, min_token_id=3),
                         batch_size=4)
    src, batches, got = rows(cfg, vocab=100)
    assert src.total == 25 and len(got) == 25 and all(len(b) <= 4 for b in batches)
    a = [r for r in got if r.id.startswith("a-")]
    b = [r for r in got if r.id.startswith("b-")]
    assert all(r.prompt[:16] == a[0].prompt[:16] for r in a)  # the shared preamble
    assert all(10 <= len(r.prompt) - 16 <= 80 for r in a) and len({len(r.prompt) for r in a}) > 3
    assert all(len(r.prompt) == 7 and r.max_tokens is None for r in b)
    assert all(3 <= t < 100 for r in got for t in r.prompt)
    _, _, again = rows(cfg, vocab=100)
    assert [r.prompt for r in again] == [r.prompt for r in got]


def test_synthetic_group_arrivals_order_rows():
    from ladle.runner.config import ArrivalConfig

    groups = [SyntheticGroup(name="s", num_requests=2),
              SyntheticGroup(name="l", num_requests=4, arrival=ArrivalConfig(process="poisson", rate=10, start=0.1))]
    _, _, got = rows(WorkloadConfig(kind="synthetic", synthetic=SyntheticConfig(groups=groups)), vocab=50)
    assert [r.id for r in got[:2]] == ["s-0", "s-1"] and got[0].arrival == 0.0
    times = [r.arrival for r in got]
    assert times == sorted(times) and times[2] > 0.1


TOK = ByteTokenizer()


@pytest.mark.parametrize(("value", "fmt", "ids", "error"), [
    ("hi", "auto", [104, 105], None),
    ("hi", "text", [104, 105], None),
    ([5, 6], "auto", [5, 6], None),
    ([{"role": "user", "content": "hi"}], "auto", TOK.apply_chat_template([{"role": "user", "content": "hi"}]), None),
    (None, "auto", None, "null"),
    ("", "auto", [], "empty"),
    ("  \n", "auto", [], "empty"),
    ([], "auto", [], "empty"),
    ("hi", "tokens", None, "expected tokens"),
    (42, "auto", None, "is a int"),
    ([1.5, 2], "auto", None, None),  # a list of floats is none of the formats
    ([5, "x"], "tokens", None, "tokenized"),
    ([{"role": "user"}], "chat", TOK.apply_chat_template([{"role": "user", "content": ""}]), None),  # as vLLM
    ([{"content": "hi"}], "chat", None, "message 0"),
])
def test_encode_prompt(value, fmt, ids, error):
    enc = encode_prompt(value, fmt, TOK, False, "prompt")
    if error is None and ids is None:
        assert enc.error is not None
        return
    assert enc.token_ids == ids
    assert (enc.error is None) if error is None else (error in enc.error)


def test_encode_prompt_chat_template_and_text_column():
    enc = encode_prompt("hi", "auto", TOK, True, "prompt")
    assert enc.token_ids == TOK.apply_chat_template([{"role": "user", "content": "hi"}]) and enc.text == "hi"
    msgs = [{"role": "user", "content": "é"}]
    assert json.loads(encode_prompt(msgs, "chat", TOK, False, "m").text) == msgs


def test_chat_template_kwargs_from_the_workload_config():
    from ladle.runner.config import to_job_config
    from tests.runner.conftest import compose_cfg

    job = to_job_config(compose_cfg("workload.chat_template=true",
                                    "+workload.chat_template_kwargs.enable_thinking=false"))
    assert job.workload.chat_template_kwargs == {"enable_thinking": False}

    seen = {}

    class Recording:
        def apply_chat_template(self, messages, **kw):
            seen.update(kw)
            return [1, 2]

    enc = encode_prompt("hi", "auto", Recording(), True, "prompt", job.workload.chat_template_kwargs)
    assert enc.token_ids == [1, 2] and seen == {"enable_thinking": False}


def write_arrow(path, table: pa.Table, chunk: int | None = None) -> None:
    with pa.ipc.new_file(path, table.schema) as w:
        for b in table.to_batches(max_chunksize=chunk):
            w.write_batch(b)


def write(path, table: pa.Table, kind: str, chunk: int | None = None) -> str:
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=chunk)
    else:
        write_arrow(path, table, chunk)
    return str(path)


def trace(kind: str, path: str, column: str = "arrival", **kw) -> WorkloadConfig:
    return WorkloadConfig(kind=kind, path=path, arrivals=ArrivalConfig(process="trace", column=column), **kw)


def read_all(w: WorkloadConfig) -> list:
    return [r for b in open_source(w).batches() for r in b]


# -- Bug A: every arrow file's columns ------------------------------------------------------------------------
def test_arrow_file_without_the_prompt_column_is_a_config_error_naming_it(tmp_path):
    write_arrow(tmp_path / "a.arrow", pa.table({"prompt": ["one", "two"], "id": ["a", "b"]}))
    write_arrow(tmp_path / "b.arrow", pa.table({"text": ["three"], "id": ["c"]}))
    with pytest.raises(ConfigError, match=r"prompt_column='prompt' is not a column of '[^']*b\.arrow'.*text, id"):
        open_source(WorkloadConfig(kind="arrow", path=str(tmp_path), id_column="id"))


def test_arrow_file_without_an_optional_column_reads_it_as_null(tmp_path):
    """As Parquet reads a directory of files with mixed schemas."""
    write_arrow(tmp_path / "a.arrow", pa.table({"prompt": ["one", "two"], "id": ["a", "b"], "k": [1, 2]}))
    write_arrow(tmp_path / "b.arrow", pa.table({"prompt": ["three"]}))
    got = read_all(WorkloadConfig(kind="arrow", path=str(tmp_path), id_column="id", max_tokens_column="k"))
    assert [(r.prompt, r.max_tokens) for r in got] == [("one", 1), ("two", 2), ("three", None)]
    assert [r.id for r in got[:2]] == ["a", "b"]  # (a null id's row: runner/sources/base.py decides)


def test_arrow_later_file_types_are_checked(tmp_path):
    write_arrow(tmp_path / "a.arrow", pa.table({"prompt": ["one"]}))
    write_arrow(tmp_path / "b.arrow", pa.table({"prompt": [7]}))
    with pytest.raises(ConfigError, match=r"'[^']*b\.arrow' has type int64"):
        open_source(WorkloadConfig(kind="arrow", path=str(tmp_path)))


def test_arrow_trace_column_missing_from_a_later_file(tmp_path):
    write_arrow(tmp_path / "a.arrow", pa.table({"prompt": ["one"], "arrival": [0.0]}))
    write_arrow(tmp_path / "b.arrow", pa.table({"prompt": ["two"]}))
    with pytest.raises(ConfigError, match=r"arrivals.column='arrival' is not a column of '[^']*b\.arrow'"):
        open_source(trace("arrow", str(tmp_path)))


def test_parquet_file_without_the_prompt_column_is_a_config_error_naming_it(tmp_path):
    """The dataset's schema is the first file's; a later file without the prompt read it as null."""
    pq.write_table(pa.table({"prompt": ["one"], "id": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["two"], "id": ["b"]}), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match=r"prompt_column='prompt' is not a column of '[^']*b\.parquet'"):
        open_source(WorkloadConfig(kind="parquet", path=str(tmp_path)))
    pq.write_table(pa.table({"prompt": ["two"]}), tmp_path / "b.parquet")  # no id: read as null, as before
    got = read_all(WorkloadConfig(kind="parquet", path=str(tmp_path), id_column="id"))
    assert [r.prompt for r in got] == ["one", "two"] and got[0].id == "a"


# -- Bug B: empty column names ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "key"), [
    ("workload.prompt_column=", "workload.prompt_column is empty"),
    ("workload.id_column=", "workload.id_column is empty.*null"),
    ("workload.class_column=", "workload.class_column is empty.*null"),
    ("workload.max_tokens_column=", "workload.max_tokens_column is empty.*null"),
])
def test_empty_column_names_are_config_errors(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        check(to_job_config(compose_cfg("workload=parquet", f"workload.path={tmp_path}", override)))


def test_empty_trace_column_is_a_config_error_only_for_a_trace(tmp_path):
    cfg = ["workload=parquet", f"workload.path={tmp_path}", "workload.arrivals.column="]
    check(to_job_config(compose_cfg(*cfg)))  # not read: arrivals are offline
    with pytest.raises(ConfigError, match="workload.arrivals.column is empty"):
        check(to_job_config(compose_cfg(*cfg, "workload.arrivals.process=trace")))


def test_check_columns_refuses_an_empty_name(tmp_path):
    """Sources opened without the config check (tests, the driver's passes) refuse it too."""
    pq.write_table(pa.table({"prompt": ["one"]}), tmp_path / "p.parquet")
    with pytest.raises(ConfigError, match="prompt_column='' is not a column"):
        open_source(WorkloadConfig(kind="parquet", path=str(tmp_path / "p.parquet"), prompt_column=""))
    with pytest.raises(ConfigError, match="arrivals.column='' is not a column"):
        open_source(trace("parquet", str(tmp_path / "p.parquet"), column=""))


# -- Bug C: the prompt's and a trace's column types -------------------------------------------------------------
CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.mark.parametrize("array", [
    pa.array(["hi"]), pa.array(["hi"], pa.large_string()), pa.array(["hi"]).dictionary_encode(),
    pa.array([[{"role": "user", "content": "hi"}]], CHAT), pa.array([[1, 2]], pa.list_(pa.int32())),
    pa.array([[1, 2]], pa.large_list(pa.int64())), pa.nulls(1),
], ids=lambda a: str(a.type))
@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_prompt_column_types_that_can_hold_prompts(tmp_path, kind, array):
    open_source(WorkloadConfig(kind=kind, path=write(tmp_path / "p", pa.table({"prompt": array}), kind)))


@pytest.mark.parametrize("array", [
    pa.array([1]), pa.array([1.5]), pa.array([True]), pa.array([b"hi"]), pa.array([[1.5]]),
    pa.array([datetime.datetime(2024, 1, 1)], pa.timestamp("ms")),
], ids=lambda a: str(a.type))
@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_prompt_column_types_that_cannot_are_config_errors(tmp_path, kind, array):
    path = write(tmp_path / "p", pa.table({"q": array}), kind)
    t = re.escape(str(array.type).split("<")[0])  # (Parquet renames a list's item field)
    with pytest.raises(ConfigError, match=rf"prompt_column='q' in '[^']*' has type {t}[^,]*, which cannot hold prompts"
                                          r".*text \(a string column\) or chat messages.*or token ids"):
        open_source(WorkloadConfig(kind=kind, path=path, prompt_column="q"))


def test_a_forced_prompt_format_needs_its_type(tmp_path):
    path = write(tmp_path / "p.parquet", pa.table({"prompt": ["hi"]}), "parquet")
    open_source(WorkloadConfig(kind="parquet", path=path, prompt_format="text"))
    with pytest.raises(ConfigError, match=r"prompt_format=tokens it must hold token ids"):
        open_source(WorkloadConfig(kind="parquet", path=path, prompt_format="tokens"))


def test_hf_saved_dataset_prompt_type_is_checked(tmp_path):
    import datasets

    datasets.Dataset(pa.table({"prompt": [1, 2]})).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="has type int64, which cannot hold prompts"):
        open_source(WorkloadConfig(kind="hf_dataset", path=str(tmp_path / "hf")))


@pytest.mark.parametrize("array", [
    pa.array([0.5]), pa.array([1], pa.int32()), pa.array(["0.5"]), pa.array([decimal.Decimal("0.5")]), pa.nulls(1),
], ids=lambda a: str(a.type))
def test_trace_column_types_that_can_hold_times(tmp_path, array):
    open_source(trace("parquet", write(tmp_path / "p", pa.table({"prompt": ["hi"], "arrival": array}), "parquet")))


@pytest.mark.parametrize(("array", "fix"), [
    (pa.array([datetime.datetime(2024, 1, 1)], pa.timestamp("ms")), "convert it to seconds"),
    (pa.array([datetime.date(2024, 1, 1)]), "convert it to seconds"),
    (pa.array([True]), "point workload.arrivals.column at a column of numbers"),
], ids=lambda a: str(getattr(a, "type", "")))
@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_trace_column_types_that_cannot_are_config_errors(tmp_path, kind, array, fix):
    path = write(tmp_path / "p", pa.table({"prompt": ["hi"], "arrival": array}), kind)
    with pytest.raises(ConfigError, match=rf"arrivals.column='arrival' in '[^']*' has type .*: they are numbers.*{fix}"):
        open_source(trace(kind, path))


# -- Bug D: a trace's order -------------------------------------------------------------------------------------
def unsorted(kind: str, tmp_path, times: list, **table) -> str:
    return write(tmp_path / "p", pa.table({"prompt": [f"p{i}" for i in range(len(times))], "arrival": times,
                                           **table}), kind, chunk=2)


@pytest.mark.parametrize("kind", ["parquet", "arrow", "hf_dataset"])
def test_an_unsorted_trace_is_a_config_error_naming_the_row(tmp_path, kind):
    times = [10.0, 10.0, 0.0, 0.0, 0.0, 0.0]
    if kind == "hf_dataset":
        import datasets

        datasets.Dataset(pa.table({"prompt": ["p"] * 6, "arrival": times})).save_to_disk(str(tmp_path / "hf"))
        path = str(tmp_path / "hf")
    else:
        path = unsorted(kind, tmp_path, times)
    with pytest.raises(ConfigError, match=r"arrivals.column='arrival' in .* is not in arrival order: row 2 \(from 0\) "
                                          r"arrives at 0 s, before row 1 at 10 s.*sort the dataset by 'arrival'"):
        open_source(trace(kind, path))


def test_an_unsorted_jsonl_trace_is_a_config_error_naming_the_row(tmp_path):
    lines = [{"prompt": "a", "arrival": 10}, "not json", {"prompt": "b", "arrival": 10.5},
             {"prompt": "c", "arrival": "2"}]
    (tmp_path / "t.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(ConfigError, match=r"row 3 \(from 0\) arrives at 2 s, before row 2 at 10.5 s"):
        open_source(trace("jsonl", str(tmp_path / "t.jsonl")))
    assert len(read_all(trace("jsonl", str(tmp_path / "t.jsonl"), limit=3))) == 3  # the rows read are in order


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_the_order_is_checked_across_batches_and_files(tmp_path, kind):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / f"a.{kind}", pa.table({"prompt": ["a", "b", "c"], "arrival": [0.0, 1.0, 2.0]}), kind, 2)
    write(tmp_path / "d" / f"b.{kind}", pa.table({"prompt": ["d"], "arrival": [1.5]}), kind)
    with pytest.raises(ConfigError, match=r"row 3 \(from 0\) arrives at 1.5 s, before row 2 at 2 s"):
        open_source(trace(kind, str(tmp_path / "d")))


def test_rows_that_are_no_time_do_not_count(tmp_path):
    """Null, NaN, negative and unreadable values are their rows' errors; the others are in order."""
    open_source(trace("parquet", unsorted("parquet", tmp_path, [0.0, None, 5.0, float("nan"), -1.0, 5.0, 7.0])))
    text = unsorted("parquet", tmp_path, ["1", "x", "2", "1e400", "3", "0.5"])
    with pytest.raises(ConfigError, match=r"row 5 \(from 0\) arrives at 0.5 ms, before row 4 at 3 ms"):
        w = trace("parquet", text)
        w.arrivals.unit = "ms"
        open_source(w)


def test_rows_past_the_limit_are_not_checked(tmp_path):
    path = unsorted("parquet", tmp_path, [0.0, 1.0, 0.5])
    assert len(read_all(trace("parquet", path, limit=2))) == 2
    with pytest.raises(ConfigError, match="row 2"):
        open_source(trace("parquet", path, limit=3))


def test_rows_of_classes_with_their_own_arrivals_do_not_count(tmp_path):
    path = unsorted("parquet", tmp_path, [0.0, 9.0, 1.0], cls=["a", "doc", "a"])
    w = trace("parquet", path, class_column="cls", class_arrivals={"doc": ArrivalConfig(process="poisson")})
    open_source(w)
    w.class_arrivals = {}
    with pytest.raises(ConfigError, match="row 2"):
        open_source(w)
    # The trace's own rows are still checked among themselves (the other class's rows left out).
    path = unsorted("parquet", tmp_path, [5.0, 9.0, 1.0], cls=["a", "doc", "a"])
    w = trace("parquet", path, class_column="cls", class_arrivals={"doc": ArrivalConfig(process="poisson")})
    with pytest.raises(ConfigError, match=r"row 2 \(from 0\) arrives at 1 s, before row 0 at 5 s"):
        open_source(w)


def test_check_trace_order_takes_python_values():
    """As a JSONL reader would hand them over (one dict of lists per batch)."""
    from ladle.runner.sources.columns import check_trace_order

    w = WorkloadConfig(arrivals=ArrivalConfig(process="trace", column="t"))
    check_trace_order(w, [{"t": [0, None, "1.5", "x"]}, {"t": [2, 10**400, {"x": 1}, -3, 2]}], "here")
    with pytest.raises(ConfigError, match=r"row 4 \(from 0\) arrives at 1 s, before row 3 at 2 s"):
        check_trace_order(w, [{"t": [0, None, 1]}, {"t": [2, 1]}], "here")


# -- all before the model loads ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "overrides", "words"), [
    ({"prompt": [1, 2]}, [], "has type int64"),
    ({"prompt": ["a", "b"]}, ["workload.prompt_column="], "prompt_column is empty"),
    ({"prompt": ["a", "b"], "arrival": [1.0, 0.0]}, ["workload.arrivals.process=trace"], "not in arrival order"),
])
def test_the_checks_come_before_the_model_loads(tmp_path, no_model_load, data, overrides, words):
    from ladle.runner.executors.local import Local

    pq.write_table(pa.table(data), tmp_path / "p.parquet")
    cfg = compose_cfg("workload=parquet", f"workload.path={tmp_path}/p.parquet", *overrides)
    with pytest.raises(ConfigError, match=words):
        Local().run(cfg, tmp_path / "out")


def test_an_extension_type_is_checked_as_its_storage(tmp_path):
    """Arrow's canonical JSON extension (arrow.json over strings) reads as text: it was refused."""
    col = pa.ExtensionArray.from_storage(pa.json_(pa.string()), pa.array(['"hello"', '{"q": 1}']))
    path = tmp_path / "p.arrow"
    write_arrow(path, pa.table({"prompt": col}))
    assert [r.prompt for r in read_all(WorkloadConfig(kind="arrow", path=str(path)))] == ['"hello"', '{"q": 1}']


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_executor_ray_reads_a_file_without_the_optional_id_column(tmp_path, kind):
    """A directory whose second file lacks the id column reads it as null for executor=local; executor=ray's
    id pass refused it (naming prompt_column='id') and a Parquet replica's shard read raised KeyError."""
    from ladle.runner.executors.shards import duplicate_indices
    from ladle.runner.sources.shard import Routing, Shard

    d = tmp_path / "d"
    d.mkdir()
    write(d / f"part-0.{kind}", pa.table({"id": ["a", "b"], "prompt": ["p0", "p1"]}), kind)
    write(d / f"part-1.{kind}", pa.table({"prompt": ["p2", "p3"]}), kind)
    w = WorkloadConfig(kind=kind, path=str(d), id_column="id")
    routing = Routing(2, 1)
    assert duplicate_indices(w, routing) == {}
    rows = [r for b in open_source(w, Shard(1, routing, None, "id")).batches() for r in b]
    assert [(r.index, r.id, r.prompt) for r in rows] == [(1, "b", "p1"), (3, None, "p3")]
    assert "id is null" in rows[1].error
