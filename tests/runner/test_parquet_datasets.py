"""Parquet directories as pandas, Spark and Ray Data write them: parts whose schemas differ only by an
all-null column or a wider type, stray non-data files, hive partitions. Read the same by executor=local
and by executor=ray's replicas (their shares, read without Ray) and its driver's id pass."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError, to_job_config
from ladle.runner.executors.shards import duplicate_indices
from ladle.runner.job import run_job
from ladle.runner.sources import open_source
from ladle.runner.sources.shard import Routing, Shard
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine


def workload(path: Path, *overrides: str):
    return to_job_config(compose_cfg("workload=parquet", f"workload.path={path}", *overrides)).workload


def rows_of(source) -> list[tuple]:
    return [(r.index, r.id, r.prompt, r.klass, r.max_tokens, r.error) for b in source.batches() for r in b]


def local_and_shares(path: Path, *overrides: str) -> tuple[list[tuple], list[tuple]]:
    """The rows executor=local reads, and the union of two replicas' shares (blocks of 2 rows)."""
    w = workload(path, *overrides)
    routing = Routing(2, 2)
    dups = duplicate_indices(w, routing)  # the driver's pass over the id column
    shares = [r for k in range(2) for r in rows_of(open_source(w, Shard(k, routing, dups.get(k), w.id_column)))]
    return rows_of(open_source(w)), sorted(shares)


@pytest.fixture
def null_then_values(tmp_path) -> Path:
    """pandas writes an all-None column as Arrow null: part 0 has it so, part 1 has strings in it; an int32
    max_tokens in one part and int64 in the other."""
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["p0", "p1", "p2"], "tag": pa.nulls(3),
                             "mt": pa.array([1, 2, 3], pa.int32())}), d / "part-0.parquet")
    pq.write_table(pa.table({"id": ["d", "e"], "prompt": ["p3", "p4"], "tag": ["x", "y"],
                             "mt": pa.array([4, None], pa.int64())}), d / "part-1.parquet")
    return d


def test_parts_with_an_all_null_column_and_values_in_another_part_are_read_whole(null_then_values, tmp_path):
    """Before, the job crashed part-way (`Unsupported cast from large_string to null`), rows already written."""
    over = ("workload.id_column=id", "workload.class_column=tag", "workload.max_tokens_column=mt")
    local, shares = local_and_shares(null_then_values, *over)
    assert local == shares == [(0, "a", "p0", None, 1, None), (1, "b", "p1", None, 2, None),
                               (2, "c", "p2", None, 3, None), (3, "d", "p3", "x", 4, None),
                               (4, "e", "p4", "y", None, None)]
    cfg = compose_cfg("workload=parquet", f"workload.path={null_then_values}", *over)
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    got = pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()
    assert sorted((r["id"], r["class"], r["error"]) for r in got) == [
        ("a", None, None), ("b", None, None), ("c", None, None), ("d", "x", None), ("e", "y", None)]


def test_parts_whose_types_truly_conflict_are_refused_naming_both_files_and_types(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["p0"], "id": ["a"]}), d / "part-0.parquet")
    pq.write_table(pa.table({"prompt": ["p1"], "id": pa.array([7], pa.int64())}), d / "part-1.parquet")
    with pytest.raises(ConfigError) as e:
        open_source(workload(d, "workload.id_column=id"))
    msg = str(e.value)
    assert "'id'" in msg and "string in" in msg and "int64 in" in msg, msg
    assert "part-0.parquet" in msg and "part-1.parquet" in msg, msg


def test_the_cli_refuses_conflicting_parts_with_exit_2_before_the_model_loads(tmp_path):
    from tests.runner.test_cli import FAST, ladle

    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["p0"]}), d / "part-0.parquet")
    pq.write_table(pa.table({"prompt": pa.array([1], pa.int64())}), d / "part-1.parquet")
    p = ladle(f"workload.path={d}", f"hydra.run.dir={tmp_path / 'out'}", *FAST, cwd=tmp_path)
    assert p.returncode == 2 and "disagree on column 'prompt'" in p.stderr, p.stderr[-3000:]
    assert "loading model" not in p.stderr


def test_non_data_files_are_skipped_and_named(null_then_values, caplog):
    """Spark's _SUCCESS and .crc files, a stats.json, a hidden file: before, a traceback and exit 1."""
    d = null_then_values
    (d / "_SUCCESS").write_text("")
    (d / ".part-0.parquet.crc").write_bytes(b"\x00crc")
    (d / "stats.json").write_text('{"rows": 5}')
    (d / "_metadata").write_bytes(b"not data")
    local, shares = local_and_shares(d, "workload.id_column=id")
    assert [r[1] for r in local] == [r[1] for r in shares] == ["a", "b", "c", "d", "e"]
    with caplog.at_level(logging.INFO, logger="ladle"):
        open_source(workload(d))
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and all(n in skipped[0] for n in ("_SUCCESS", ".part-0.parquet.crc", "stats.json"))


def test_a_directory_without_data_files_says_so(tmp_path):
    (tmp_path / "stats.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no Parquet data files.*stats.json"):
        open_source(workload(tmp_path))


def test_hive_partition_keys_are_columns(tmp_path):
    """pandas partition_cols / Spark / Ray Data layout: before, class_column=lang was a config error."""
    root = tmp_path / "ds"
    pq.write_to_dataset(pa.table({"prompt": ["hello", "bonjour", "hi", "salut"], "lang": ["en", "fr", "en", "fr"],
                                  "year": [2024, 2024, 2025, 2025]}), root, partition_cols=["year", "lang"])
    local, shares = local_and_shares(root, "workload.class_column=lang", "+workload.columns={seed: year}")
    assert local == shares
    assert sorted((r[2], r[3]) for r in local) == [("bonjour", "fr"), ("hello", "en"), ("hi", "en"), ("salut", "fr")]
    w = workload(root, "workload.class_column=lang", "+workload.columns={seed: year}")
    seeds = {r.prompt: r.sampling["seed"] for b in open_source(w).batches() for r in b}
    assert seeds == {"hello": 2024, "bonjour": 2024, "hi": 2025, "salut": 2025}


def test_a_categorical_column_in_one_part_and_strings_in_another_read_as_strings(tmp_path):
    """pandas writes a categorical as an Arrow dictionary: it unifies with another part's plain strings."""
    import pandas as pd

    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame({"prompt": ["p0", "p1"], "c": pd.Categorical(["x", "y"])})),
                   d / "part-0.parquet")
    pq.write_table(pa.table({"prompt": ["p2"], "c": ["z"]}), d / "part-1.parquet")
    local, shares = local_and_shares(d, "workload.class_column=c")
    assert local == shares
    assert [(r[2], r[3]) for r in local] == [("p0", "x"), ("p1", "y"), ("p2", "z")]


def test_a_partition_key_that_is_also_a_column_of_another_type_is_refused(tmp_path):
    root = tmp_path / "ds"
    (root / "lang=en").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["p0"], "lang": pa.array([[1]], pa.list_(pa.int64()))}),
                   root / "lang=en" / "part-0.parquet")
    with pytest.raises(ConfigError, match="partition directory's key is also a column"):
        open_source(workload(root))


def test_parts_with_no_rows_are_left_out_whatever_their_columns(tmp_path, caplog):
    """Spark and Ray Data write empty partitions as parts with no rows, pandas an empty frame as a part with
    no columns: they hold nothing to run, so neither a missing prompt column nor a type the other parts do
    not have may stop the job (before, the part without columns was refused as lacking the prompt)."""
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["p0", "p1", "p2"]}), d / "part-0.parquet")
    pq.write_table(pa.table({}), d / "part-1.parquet")  # no rows, no columns
    pq.write_table(pa.table({"prompt": pa.array([], pa.int64())}), d / "part-2.parquet")  # no rows, another type
    pq.write_table(pa.table({"prompt": ["p3"]}), d / "part-3.parquet")
    with caplog.at_level(logging.INFO, logger="ladle"):
        local, shares = local_and_shares(d)
    expected = [(0, "0", "p0", None, None, None), (1, "1", "p1", None, None, None),
                (2, "2", "p2", None, None, None), (3, "3", "p3", None, None, None)]
    assert local == shares == expected
    assert "2 Parquet parts with no rows: part-1.parquet, part-2.parquet" in caplog.text
    out = tmp_path / "out"
    result = run_job(compose_cfg("workload=parquet", f"workload.path={d}"), out, engine=FakeEngine(max_num_seqs=2))
    assert result.summary["requests"] == 4 and result.summary["errors"] == 0


def test_a_directory_whose_parts_all_have_no_rows_runs_no_request(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), d / "part-0.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), d / "part-1.parquet")
    assert rows_of(open_source(workload(d))) == []


@pytest.mark.parametrize("log_dir,marker,name", [("_delta_log", "00000000000000000000.json", "Delta Lake"),
                                                 (".hoodie", "hoodie.properties", "Hudi"),
                                                 ("metadata", "v1.metadata.json", "Iceberg"),
                                                 ("_spark_metadata", "0", "Spark streaming sink's output")])
def test_a_table_format_directory_is_refused_naming_it(tmp_path, log_dir, marker, name):
    """A Delta, Hudi or Iceberg table keeps the files of rows it deleted or overwrote until they are vacuumed;
    only its log says which files are the table. Read as plain Parquet, the overwritten rows ran again
    beside their replacements (before, silently: the log directory was skipped as hidden or not Parquet)."""
    d = tmp_path / "table"
    (d / log_dir).mkdir(parents=True)
    (d / log_dir / marker).write_text("{}")
    pq.write_table(pa.table({"prompt": ["old version of row 0"]}), d / "part-00000-a.snappy.parquet")
    pq.write_table(pa.table({"prompt": ["new version of row 0"]}), d / "part-00000-b.snappy.parquet")
    with pytest.raises(ConfigError, match=f"is an? .*{name}.*{log_dir}/.*plain Parquet"):
        open_source(workload(d))


def test_a_directory_named_metadata_without_iceberg_files_is_not_a_table(tmp_path):
    d = tmp_path / "parts"
    (d / "metadata").mkdir(parents=True)
    (d / "metadata" / "notes.json").write_text("{}")
    pq.write_table(pa.table({"prompt": ["p0"]}), d / "part-0.parquet")
    assert [r[2] for r in rows_of(open_source(workload(d)))] == ["p0"]
