"""A secret passed on the command line never reaches the outputs, logs, summary.json, the saved Hydra config
or an error message (runner/redact.py), run end to end through the CLI against an S3 API server."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from tests.runner.conftest import PROMPTS
from tests.runner.s3_server import KEYS
from tests.runner.test_cli import FAST, ladle

SECRET = KEYS["AWS_SECRET_ACCESS_KEY"]


def files_holding(root: Path, secret: str) -> list[str]:
    return [str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]


def test_a_credential_value_in_an_override_is_masked_everywhere(s3, tmp_path):
    """The secret key's value, quoted in an override (a chat template variable here), is in the environment
    the S3 reads use; the run reads from S3 and writes its files, none of which holds the value."""
    uri = s3.put("in/prompts.parquet", pa.table({"prompt": PROMPTS[:3]}))
    out = tmp_path / "run"
    p = ladle(f"hydra.run.dir={out}", "workload=parquet", f"workload.path={uri}", "output.plots=false",
              f"+workload.chat_template_kwargs.api_key={SECRET}", *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "generations.parquet").exists() and (out / ".hydra" / "overrides.yaml").exists()
    assert files_holding(out, SECRET) == []
    assert SECRET not in p.stdout + p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "+workload.chat_template_kwargs.api_key=***" in summary["overrides"]


def test_credentials_inside_a_uri_are_refused_and_never_shown(s3, tmp_path):
    key_id, secret = "AKIAEXAMPLEKEYID", "Ex4mple/Secret+Value"
    out = tmp_path / "run"
    p = ladle(f"hydra.run.dir={out}", "workload=parquet", f"workload.path=s3://{key_id}:{secret}@{s3.name}/x.parquet",
              *FAST, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "carries credentials" in p.stderr and "AWS_SECRET_ACCESS_KEY" in p.stderr
    for text in (key_id, secret):
        assert text not in p.stdout + p.stderr
        assert files_holding(out, text) == []


def test_a_sweep_keeps_each_jobs_outputs_apart_under_output_path(s3, tmp_path):
    uri = s3.put("in/prompts.parquet", pa.table({"prompt": PROMPTS[:2]}))
    sweep = tmp_path / "sweep"
    p = ladle("--multirun", "chunking.size=16,64", f"hydra.sweep.dir={sweep}", "workload=parquet",
              f"workload.path={uri}", f"output.path={s3.uri('sweep')}", "output.plots=false",
              f"+workload.chat_template_kwargs.api_key={SECRET}", *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    objects = [k for k in s3.list_keys("sweep/") if not k.endswith("/")]
    assert objects == [f"sweep/{i}/{name}" for i in (0, 1)
                       for name in ("generations.parquet", "steps.parquet", "summary.json")]
    assert (sweep / "sweep.parquet").exists() and files_holding(sweep, SECRET) == []
    assert "api_key=***" in p.stdout + p.stderr and SECRET not in p.stdout + p.stderr  # Hydra logs the jobs' overrides
