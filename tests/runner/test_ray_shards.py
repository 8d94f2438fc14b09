"""Replica shares (runner/sources/shard.py, runner/executors/shards.py): the shares of every source are
disjoint, together are exactly the rows executor=local reads (same index, id, prompt, error), and a
replica reads only its own Parquet row groups and parses only its own JSONL lines. No Ray needed."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ladle.runner.sources.jsonl as source_mod
from ladle.runner.config import to_job_config
from ladle.runner.executors.shards import duplicate_indices
from ladle.runner.sources import open_source
from ladle.runner.sources.shard import Routing, Shard
from tests.runner.conftest import compose_cfg


def _workload(*overrides: str):
    return to_job_config(compose_cfg(*overrides)).workload


def _rows(src):
    return [(r.index, r.id, r.prompt, r.error) for b in src.batches() for r in b]


@pytest.mark.parametrize("n,block", [(1, 1), (2, 1), (3, 2), (2, 4), (5, 3), (4, 256)])
def test_share_size_and_owner_agree(n, block):
    r = Routing(n, block)
    for total in (0, 1, block - 1, block, block + 1, n * block, n * block + 1, 3 * n * block + block // 2 + 1):
        counts = [0] * n
        for i in range(total):
            counts[r.owner(i)] += 1
        assert [r.share_size(k, total) for k in range(n)] == counts
        for lo in range(0, total, max(1, total // 7)):
            for hi in (lo, lo + 1, lo + block, total):
                assert r.owns_any(0, lo, hi) == any(r.owner(i) == 0 for i in range(lo, hi)), (lo, hi)


@pytest.fixture
def many_groups(tmp_path):
    """50 rows in row groups of 4, two files, with a duplicate id and a null prompt."""
    ids = [f"r{i}" for i in range(50)]
    ids[37] = "r3"
    prompts = [f"prompt {i}" for i in range(50)]
    prompts[11] = None
    t = pa.table({"id": ids, "prompt": prompts})
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(t.slice(0, 22), d / "a.parquet", row_group_size=4)
    pq.write_table(t.slice(22), d / "b.parquet", row_group_size=4)
    return d


@pytest.mark.parametrize("n,block,limit", [(2, 1, None), (3, 4, None), (2, 5, 31), (4, 3, 7), (8, 16, None)])
def test_parquet_shares_partition_the_local_rows(many_groups, n, block, limit):
    over = ["workload=parquet", f"workload.path={many_groups}", "workload.id_column=id", "workload.batch_size=3"]
    if limit is not None:
        over.append(f"workload.limit={limit}")
    w = _workload(*over)
    local = _rows(open_source(w))
    routing = Routing(n, block)
    dups = duplicate_indices(w, routing)
    shares = [_rows(open_source(w, Shard(k, routing, dups.get(k), w.id_column))) for k in range(n)]
    merged = sorted(r for s in shares for r in s)
    # local marks a duplicate id in its job loop; the shard marks it from the driver's id pass
    expect = [(i, rid, p, "duplicate id 'r3' in column 'id'" if i == 37 else e) for i, rid, p, e in local]
    assert merged == [e for e in expect if limit is None or e[0] < limit]
    for k, s in enumerate(shares):
        assert all(routing.owner(i) == k for i, *_ in s)
        assert [i for i, *_ in s] == sorted(i for i, *_ in s)  # source order within a share
        src = open_source(w, Shard(k, routing))
        assert src.total == len(s)


def test_parquet_replica_reads_only_its_row_groups(many_groups, monkeypatch):
    w = _workload("workload=parquet", f"workload.path={many_groups / 'a.parquet'}")
    read: list[int] = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, row_groups=None, **kw):
        read.extend(row_groups)
        return real(self, *a, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    # 22 rows in row groups of 4; blocks of 4 rows over 2 replicas: replica 1 owns groups 1, 3, 5
    rows = _rows(open_source(w, Shard(1, Routing(2, 4))))
    assert read == [1, 3, 5]
    assert [i for i, *_ in rows] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]


def test_jsonl_replica_parses_only_its_lines_and_keeps_bad_lines_as_errors(tmp_path, monkeypatch):
    lines = [json.dumps({"prompt": f"p{i}", "id": f"x{i}"}) for i in range(12)]
    lines[5] = "{not json"
    lines[8] = json.dumps({"prompt": "p8", "id": "x2"})  # duplicate id
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")  # a blank line is no row
    w = _workload("workload=jsonl", f"workload.path={path}", "workload.id_column=id")
    local = _rows(open_source(w))
    routing = Routing(3, 2)
    dups = duplicate_indices(w, routing)
    assert dups == {routing.owner(8): {8}}
    parsed = []
    real = json.loads
    monkeypatch.setattr(source_mod.json, "loads", lambda s, *a, **k: parsed.append(s) or real(s, *a, **k))
    shares = [_rows(open_source(w, Shard(k, routing, dups.get(k), "id"))) for k in range(3)]
    expect = [(i, rid, p, "duplicate id 'x2' in column 'id'" if i == 8 else e) for i, rid, p, e in local]
    assert sorted(r for s in shares for r in s) == expect
    assert any(e and "line 6 is not a JSON object" in e for *_, e in shares[routing.owner(5)])
    # each open_source parses the first line to check the columns; beyond that, every line once in all
    assert len(parsed) == 3 + len(lines)
    texts = [x.decode() if isinstance(x, bytes) else x for x in parsed]  # lines are parsed as bytes (UTF-8)
    assert sorted(x.strip() for x in texts[1:] if x != texts[0]) == sorted(x for x in lines if x != lines[0])


@pytest.mark.parametrize("kind", ["arrow", "hf_dataset", "synthetic"])
def test_other_sources_are_filtered_to_the_share(datasets_dir, kind):
    path = {"arrow": datasets_dir / "prompts.arrow", "hf_dataset": datasets_dir / "hf", "synthetic": None}[kind]
    over = ["workload=parquet", f"workload.kind={kind}", "workload.prompt_column=question"]
    if kind == "synthetic":
        over = ["workload=synthetic", "workload.synthetic.vocab_size=100"]
    else:
        over.append(f"workload.path={path}")
    w = _workload(*over)
    local = _rows(open_source(w))
    routing = Routing(2, 3)
    shares = [_rows(open_source(w, Shard(k, routing))) for k in range(2)]
    assert sorted(r for s in shares for r in s) == sorted(local) and all(shares)


def test_more_replicas_than_rows_gives_empty_shares(many_groups):
    w = _workload("workload=parquet", f"workload.path={many_groups}", "workload.limit=3")
    routing = Routing(5, 1)
    assert [routing.share_size(k, 3) for k in range(5)] == [1, 1, 1, 0, 0]
    assert _rows(open_source(w, Shard(4, routing))) == []


def test_merge_conforms_replicas_written_by_an_older_ladle(tmp_path):
    """A replica that was not rerun on resume keeps the file an older ladle wrote (no logprob columns,
    a column since dropped): the merge gives every row the current schema instead of failing."""
    from ladle.runner.executors.replica_files import stream_merge
    from ladle.runner.sinks import generations_schema

    schema = generations_schema(include_prompt=True)
    new = pa.Table.from_pylist([{"id": "a", "index": 0, "sample_index": 0, "output_text": "x",
                                 "logprobs": [-0.5], "top_logprobs": [[]]}], schema=schema)
    old = pa.table({"id": ["b"], "index": pa.array([1], pa.int64()), "output_text": ["y"], "retired": [1.0]})
    pq.write_table(new, tmp_path / "r0.parquet")
    pq.write_table(old, tmp_path / "r1.parquet")
    dest = stream_merge([(0, tmp_path / "r0.parquet"), (1, tmp_path / "r1.parquet")], tmp_path / "gen.parquet",
                        add_replica=False, schema=schema)
    merged = pq.read_table(dest)
    assert merged.schema.names == schema.names
    rows = merged.to_pylist()
    assert [(r["id"], r["index"], r["output_text"]) for r in rows] == [("a", 0, "x"), ("b", 1, "y")]
    assert rows[0]["logprobs"] == [-0.5] and rows[1]["logprobs"] is None
    # sample_index of an older file's row is null; it is sample 0
    assert rows[1]["sample_index"] in (None, 0)
