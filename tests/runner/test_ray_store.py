"""executor=ray reading its rows from an S3 API server (moto) and keeping its outputs there: the same greedy
outputs as executor=local on the same input, the merged files copied to output.path, no replica's own."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from tests.runner.conftest import PROMPTS, compose_cfg

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' to run the Ray tests")

COLUMNS = ["id", "index", "output_token_ids", "output_text", "finish_reason", "error"]


@pytest.fixture
def ray_with_s3(s3):
    """A local Ray cluster started once the S3 variables are set: its workers read them as the driver does."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield s3
    ray.shutdown()


def test_ray_and_local_give_the_same_greedy_outputs_from_s3(ray_with_s3, tmp_path, engine):
    s3 = ray_with_s3
    ids = [f"q{i}" for i in range(24)]
    uri = s3.put("in/prompts.parquet", pa.table({"id": ids, "prompt": [PROMPTS[i % 8] + f" ({i})" for i in range(24)]}),
                 row_group_size=5)
    common = ["workload=parquet", f"workload.path={uri}", "workload.id_column=id"]
    run_job(compose_cfg(*common, f"output.path={s3.uri('local')}"), tmp_path / "local", engine=engine)
    res = run_job(compose_cfg(*common, "executor=ray", "executor.num_replicas=2", "executor.batch_size=4",
                              f"output.path={s3.uri('ray')}"), tmp_path / "ray")
    assert not res.interrupted

    def rows(prefix: str) -> list[dict]:
        t = pq.read_table(io.BytesIO(s3.get(f"{prefix}/generations.parquet")), columns=COLUMNS)
        return sorted(t.to_pylist(), key=lambda r: r["index"])

    local, distributed = rows("local"), rows("ray")
    assert [r["id"] for r in distributed] == ids and distributed == local
    steps = pq.read_table(io.BytesIO(s3.get("ray/steps.parquet")))
    assert set(steps.column("replica").to_pylist()) == {0, 1}
    objects = [k for k in s3.list_keys("ray/") if not k.endswith("/")]
    assert objects == ["ray/generations.parquet", "ray/steps.parquet", "ray/summary.json"]
