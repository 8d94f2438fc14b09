"""Input files in the shapes other tools write them: tab-separated text read by hf_dataset, compressed
JSON Lines."""

from __future__ import annotations

import bz2
import gzip
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.job import run_job
from ladle.runner.sources import open_source
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine


def rows_of(source) -> list[tuple]:
    return [(r.index, r.id, r.prompt, r.error) for b in source.batches() for r in b]


@pytest.mark.parametrize("builder", [None, "csv"])
def test_a_tsv_file_is_read_tab_separated(tmp_path, builder):
    """Before, the header became one column named `prompt\\tid` (the comma-separated default)."""
    path = tmp_path / "data.tsv"
    path.write_text("prompt\tid\nhello, world\t7\nbonjour\t8\n")
    w = WorkloadConfig(kind="hf_dataset", path=str(path), id_column="id", hf_builder=builder)
    assert rows_of(open_source(w)) == [(0, "7", "hello, world", None), (1, "8", "bonjour", None)]


@pytest.mark.parametrize("name,data,want", [
    ("data.tsv.gz", b"prompt\tid\nhello, world\t7\n", [(0, "7", "hello, world", None)]),
    ("data.jsonl.gz", b'{"prompt": "hi", "id": "a"}\n', [(0, "a", "hi", None)]),
])
def test_hf_dataset_picks_the_builder_under_a_compression_extension(tmp_path, name, data, want):
    path = tmp_path / name
    path.write_bytes(gzip.compress(data))
    assert rows_of(open_source(WorkloadConfig(kind="hf_dataset", path=str(path), id_column="id"))) == want


LINES = b'{"id": "a", "prompt": "hello"}\n\n{"id": "b", "prompt": "bonjour"}\n'


def write_zstd(path, data: bytes) -> None:
    with pa.CompressedOutputStream(str(path), "zstd") as out:
        out.write(data)


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def write_compressed(path, data: bytes) -> None:
    if path.suffix == ".zst":
        write_zstd(path, data)
    else:
        path.write_bytes(COMPRESS[path.suffix](data))


@pytest.mark.parametrize("ext", [".gz", ".bz2", ".xz", ".zst"])
@pytest.mark.parametrize("kind", ["jsonl", "openai_batch"])
def test_compressed_jsonl_is_read_decompressed(tmp_path, ext, kind):
    """Before, `.jsonl.gz` was read as raw bytes: "no columns", nothing said of the compression."""
    path = tmp_path / f"data.jsonl{ext}"
    if kind == "jsonl":
        write_compressed(path, LINES)
        w = WorkloadConfig(kind="jsonl", path=str(path), id_column="id")
        assert rows_of(open_source(w)) == [(0, "a", "hello", None), (1, "b", "bonjour", None)]
        return
    body = b'{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n'
    write_compressed(path, body)
    assert [(r.id, r.prompt) for b in open_source(WorkloadConfig(kind="openai_batch", path=str(path))).batches()
            for r in b] == [("r1", "hi")]


def test_a_directory_mixes_plain_and_compressed_files(tmp_path):
    (tmp_path / "0.jsonl").write_bytes(b'{"prompt": "p0"}\n')
    write_compressed(tmp_path / "1.jsonl.gz", b'{"prompt": "p1"}\n')
    write_compressed(tmp_path / "2.ndjson.zst", b'{"prompt": "p2"}\n')
    (tmp_path / "stats.txt.gz").write_bytes(gzip.compress(b"not data"))
    w = WorkloadConfig(kind="jsonl", path=str(tmp_path))
    assert [r[2] for r in rows_of(open_source(w))] == ["p0", "p1", "p2"]


@pytest.mark.parametrize("compress,named", [(gzip.compress, "gzip.*data.jsonl.gz"), (lzma.compress, "xz.*data.jsonl.xz"),
                                            (bz2.compress, "bz2.*data.jsonl.bz2")])
def test_a_compressed_file_whose_name_does_not_say_so_is_refused_naming_the_fix(tmp_path, compress, named):
    path = tmp_path / "data.jsonl"
    path.write_bytes(compress(LINES))
    with pytest.raises(ConfigError, match=f"is {named}"):
        open_source(WorkloadConfig(kind="jsonl", path=str(path)))


@pytest.mark.parametrize("ext", [".gz", ".xz", ".zst"])
def test_cut_off_compressed_data_is_a_config_error_before_any_row(tmp_path, ext):
    path = tmp_path / f"data.jsonl{ext}"
    write_compressed(path, LINES * 200)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ConfigError, match="could not be decompressed.*cut off or corrupt"):
        open_source(WorkloadConfig(kind="jsonl", path=str(path)))


def test_integer_ids_pandas_stored_as_floats_are_written_as_integers(tmp_path):
    """An int id column with a missing value is float64 in pandas' Parquet: before, ids were "101.0"."""
    import pandas as pd

    path = tmp_path / "data.parquet"
    pd.DataFrame({"id": [101, None, 103, 2**53], "prompt": ["a", "b", "c", "d"]}).to_parquet(path)
    assert pq.read_schema(path).field("id").type == pa.float64()
    run_job(compose_cfg("workload=parquet", f"workload.path={path}", "workload.id_column=id"), tmp_path / "out",
            engine=FakeEngine())
    got = sorted((r["index"], r["id"], r["error"] is None) for r in pq.read_table(tmp_path / "out" /
                                                                                  "generations.parquet").to_pylist())
    assert got == [(0, "101", True), (1, None, False), (2, "103", True), (3, str(2**53), True)]


def test_a_whole_number_float_id_is_the_same_id_as_the_integer(tmp_path):
    """JSON's 7.0 and 7 name one id (the second is a repeat); 7.5 and a string stay as they are."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"id": 7, "prompt": "a"}\n{"id": 7.0, "prompt": "b"}\n{"id": 7.5, "prompt": "c"}\n'
                    '{"id": "7.0", "prompt": "d"}\n{"id": -0.0, "prompt": "e"}\n{"id": 1e300, "prompt": "f"}\n')
    rows = rows_of(open_source(WorkloadConfig(kind="jsonl", path=str(path), id_column="id")))
    assert [r[1] for r in rows] == ["7", "7", "7.5", "7.0", "0", str(int(1e300))]
    run_job(compose_cfg("workload=jsonl", f"workload.path={path}", "workload.id_column=id"), tmp_path / "out",
            engine=FakeEngine())
    errors = {r["index"]: r["error"] for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    assert errors[0] is None and errors[1] == "duplicate id '7' in column 'id'"
    assert [errors[i] for i in range(2, 6)] == [None] * 4
