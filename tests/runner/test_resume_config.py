"""Starting over and resuming with other settings: output.resume=false loses nothing until the new rows are
written; a resumed run names every setting that changed; a sweep swept again into its own directory with
other values is refused before it runs (its job directories are numbered by position)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from runner.config import ConfigError
from runner.executors.local import Local
from runner.job import run_job
from runner.resume import config_changes
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine
from tests.runner.test_cli import FAST, ladle
from tests.runner.test_job import parquet


def test_starting_over_keeps_the_previous_rows_until_this_runs_rows_are_written(tmp_path, monkeypatch):
    src = parquet(tmp_path / "p.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    run_job(compose_cfg("workload=parquet", f"workload.path={src}"), out, engine=FakeEngine())
    before = {name: pq.read_table(out / name) for name in ("generations.parquet", "steps.parquet")}

    def fails(self, job):  # as a memory-plan error or Ctrl-C while the model loads
        raise ConfigError("the run needs more memory than there is")

    monkeypatch.setattr(Local, "_load_engine", fails)
    with pytest.raises(ConfigError):
        run_job(compose_cfg("workload=parquet", f"workload.path={src}", "output.resume=false"), out)
    for name, table in before.items():  # before: both files were deleted before the model loaded
        assert pq.read_table(out / name).equals(table), name
    monkeypatch.undo()
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "output.resume=false", "sampling.max_tokens=2"),
            out, engine=FakeEngine())
    rows = pq.read_table(out / "generations.parquet").to_pylist()
    assert len(rows) == 3 and {r["attempt"] for r in rows} == {0} and {r["output_tokens"] for r in rows} == {2}


def test_config_changes_names_every_setting_but_output_and_how_much_is_read():
    old = "model:\n  name: tiny\nchunking:\n  size: 16\nworkload:\n  limit: 3\n  batch_size: 8\noutput:\n  plots: true\n"
    same = "model:\n  name: tiny\nchunking:\n  size: 16\nworkload:\n  limit: 9\n  batch_size: 2\noutput:\n  plots: false\n"
    assert config_changes(old, same) == {}
    assert config_changes(None, old) == {}
    other = same.replace("size: 16", "size: 64") + "seed: 3\n"
    changed = config_changes(old, other)
    assert list(changed) == ["chunking.size", "seed"] and changed["chunking.size"] == (16, 64)


def test_a_sweep_swept_again_with_other_values_is_refused_before_it_runs(tmp_path):
    sweep = tmp_path / "sweep"
    args = [f"hydra.sweep.dir={sweep}", "workload.limit=3", "output.plots=false", *FAST]
    first = ladle("--multirun", "chunking.size=16,64", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = pq.read_table(sweep / "0" / "generations.parquet")
    # Reordered values: job 0 would resume chunking.size=16's rows as chunking.size=64's (before: silently).
    again = ladle("--multirun", "chunking.size=64,16", *args, cwd=tmp_path)
    assert again.returncode == 2 and "chunking.size: 16 -> 64" in again.stderr, again.stderr[-3000:]
    assert "new hydra.sweep.dir" in again.stderr
    assert pq.read_table(sweep / "0" / "generations.parquet").equals(rows)
    resumed = ladle("--multirun", "chunking.size=16,64", *args, cwd=tmp_path)  # its own command resumes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
