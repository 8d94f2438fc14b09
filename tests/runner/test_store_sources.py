"""Every source kind reads an s3:// URI (a real S3 API: moto's server) as it reads the same data locally."""

from __future__ import annotations

import json

import pytest

from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.sources import Shard, open_source
from ladle.runner.sources.shard import Routing


def upload_tree(s3, local_dir, prefix: str) -> str:
    """Every file under `local_dir` as objects under `prefix`; the prefix's URI."""
    for f in sorted(local_dir.rglob("*")):
        if f.is_file():
            s3.put(f"{prefix}/{f.relative_to(local_dir).as_posix()}", f.read_bytes())
    return s3.uri(prefix)


def read_rows(w: WorkloadConfig, shard: Shard | None = None) -> list[tuple]:
    src = open_source(w, shard)
    return [(r.index, r.id, r.prompt, r.max_tokens, r.error) for b in src.batches() for r in b]


@pytest.mark.parametrize(("kind", "name"), [
    ("parquet", "prompts.parquet"), ("parquet", "parts"), ("arrow", "prompts.arrow"), ("jsonl", "prompts.jsonl"),
    ("hf_dataset", "hf"), ("hf_dataset", "prompts.jsonl"),
])
def test_s3_source_reads_the_rows_a_local_path_reads(s3, datasets_dir, kind, name):
    uri = upload_tree(s3, datasets_dir, "data")
    cols = {"prompt_column": "question", "id_column": "qid", "max_tokens_column": "max_tokens", "batch_size": 3}
    local = read_rows(WorkloadConfig(kind=kind, path=str(datasets_dir / name), **cols))
    remote = read_rows(WorkloadConfig(kind=kind, path=f"{uri}/{name}", **cols))
    assert remote == local and len(remote) == 8 and remote[1][2] == local[1][2]


def test_s3_parquet_directory_shard_reads_only_its_rows(s3, datasets_dir):
    uri = upload_tree(s3, datasets_dir / "parts", "parts")
    w = WorkloadConfig(kind="parquet", path=uri, prompt_column="question", id_column="qid", batch_size=2)
    shard = Shard(1, Routing(num_replicas=2, block_rows=2))
    got = read_rows(w, shard)
    assert [r[0] for r in got] == [2, 3, 6, 7]
    assert got == [r for r in read_rows(w) if r[0] in (2, 3, 6, 7)]


def test_s3_openai_batch_file(s3):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"say {i}", "max_tokens": i + 1}} for i in range(3)]
    uri = s3.put("batch/input.jsonl", "".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    got = read_rows(WorkloadConfig(kind="openai_batch", path=uri))
    assert [(r[1], r[2]) for r in got[:3]] == [("c0", "say 0"), ("c1", "say 1"), ("c2", "say 2")]
    assert got[3][1] is None and "not" in got[3][4]


def test_missing_object_and_unknown_bucket_are_config_errors(s3):
    with pytest.raises(ConfigError, match=r"workload.path='s3://.*/nothing.parquet' does not exist"):
        open_source(WorkloadConfig(kind="parquet", path=s3.uri("nothing.parquet")))
    with pytest.raises(ConfigError, match=r"workload.path='s3://no-such-bucket-here/x.jsonl'"):
        open_source(WorkloadConfig(kind="jsonl", path="s3://no-such-bucket-here/x.jsonl"))
    s3.put("empty/readme.txt", "x")
    with pytest.raises(ConfigError, match=r"has no .jsonl/.json/.ndjson files"):
        open_source(WorkloadConfig(kind="jsonl", path=s3.uri("empty")))
