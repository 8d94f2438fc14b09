"""output.path on an S3 API server (moto): outputs copied there atomically per object, a run resumed from
there in a fresh run directory, bad values refused before the model loads."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from tests.runner.conftest import PROMPTS, compose_cfg


class InterruptAt:
    """The engine, with Ctrl-C arriving during step `step`."""

    def __init__(self, eng, step: int) -> None:
        self.eng, self.stop_at, self.steps = eng, step, 0

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        self.steps += 1
        if self.steps >= self.stop_at:
            raise KeyboardInterrupt
        return self.eng.step()


def remote_table(s3, key: str) -> pa.Table:
    return pq.read_table(io.BytesIO(s3.get(key)))


@pytest.fixture
def s3_prompts(s3) -> str:
    return s3.put("in/prompts.parquet", pa.table({"prompt": PROMPTS}))


def test_local_run_reading_and_writing_s3(s3, s3_prompts, tmp_path, engine):
    cfg = compose_cfg("workload=parquet", f"workload.path={s3_prompts}", f"output.path={s3.uri('runs/a')}")
    res = run_job(cfg, tmp_path / "run", engine=engine)
    objects = [k for k in s3.list_keys("runs/") if not k.endswith("/")]  # pyarrow keeps a "runs/a/" directory marker
    assert objects == ["runs/a/generations.parquet", "runs/a/steps.parquet", "runs/a/summary.json"]
    gen = remote_table(s3, "runs/a/generations.parquet")
    assert gen.equals(pq.read_table(tmp_path / "run" / "generations.parquet"))
    assert sorted(gen.column("id").to_pylist(), key=int) == [str(i) for i in range(len(PROMPTS))]
    summary = json.loads(s3.get("runs/a/summary.json"))
    assert summary["output_path"] == s3.uri("runs/a") and summary["requests"] == res.summary["requests"]


def test_an_interrupted_run_resumes_from_output_path_in_a_fresh_run_directory(s3, s3_prompts, tmp_path, engine):
    cfg = compose_cfg("workload=parquet", f"workload.path={s3_prompts}", f"output.path={s3.uri('runs/b')}",
                      "max_num_seqs=2")
    first = run_job(cfg, tmp_path / "first", engine=InterruptAt(engine, 6))
    assert first.interrupted
    partial = remote_table(s3, "runs/b/generations.parquet")
    assert 0 < partial.num_rows < len(PROMPTS)
    second = run_job(cfg, tmp_path / "second", engine=engine)  # another machine: nothing local
    assert not second.interrupted
    gen = remote_table(s3, "runs/b/generations.parquet")
    ids = gen.column("id").to_pylist()
    assert sorted(ids, key=int) == [str(i) for i in range(len(PROMPTS))]  # each id exactly once
    assert set(gen.column("attempt").to_pylist()) == {0, 1}
    assert second.summary["resumed"] == partial.num_rows
    assert not [k for k in s3.list_keys() if k.endswith(".tmp")]


def test_output_path_errors_before_the_model_loads(s3, s3_prompts, tmp_path, no_model_load):
    with pytest.raises(ConfigError, match=r"output.path='s3://no-such-bucket-x/r'.*bucket 'no-such-bucket-x' does "
                                          r"not exist"):
        run_job(compose_cfg("workload=parquet", f"workload.path={s3_prompts}", "output.path=s3://no-such-bucket-x/r"),
                tmp_path / "run")
    with pytest.raises(ConfigError, match=r"output.path='s3://\*\*\*@b/r' carries credentials"):
        run_job(compose_cfg("workload=parquet", f"workload.path={s3_prompts}", "output.path=s3://K:S3CRET@b/r"),
                tmp_path / "run")


def test_a_local_output_path_gets_the_same_files(s3_prompts, tmp_path, engine):
    cfg = compose_cfg("workload=parquet", f"workload.path={s3_prompts}", f"output.path={tmp_path / 'kept'}")
    run_job(cfg, tmp_path / "run", engine=engine)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["generations.parquet", "steps.parquet",
                                                                     "summary.json"]


def test_a_copy_that_fails_keeps_the_previous_object_and_leaves_no_tmp(s3, tmp_path, monkeypatch):
    from ladle.runner.output_store import publish
    from ladle.runner.sinks import OutputError
    from ladle.runner.storage import locate

    dest = locate(s3.uri("keep"))
    f = tmp_path / "summary.json"
    f.write_text('{"v": 1}')
    publish([f], dest)
    f.write_text('{"v": 2}')

    def cut_copy(src, dst, destination_filesystem, **kwargs):  # part of the object written, then the link drops
        with destination_filesystem.open_output_stream(dst) as out:
            out.write(b'{"v": ')
        raise OSError("connection reset")

    monkeypatch.setattr("ladle.runner.output_store.pafs.copy_files", cut_copy)
    with pytest.raises(OutputError, match=r"copying summary.json to s3://.*/keep/summary.json failed.*as it was"):
        publish([f], dest)
    assert json.loads(s3.get("keep/summary.json")) == {"v": 1}
    assert [k for k in s3.list_keys("keep/") if not k.endswith("/")] == ["keep/summary.json"]
