"""What a source checks when it opens, before the model loads: every file's columns (arrow), empty column
names, the prompt's and a trace's column types, and a trace's order."""

from __future__ import annotations

import datetime
import decimal
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ArrivalConfig, ConfigError, WorkloadConfig, check, to_job_config
from ladle.runner.sources import open_source
from tests.runner.conftest import compose_cfg


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
