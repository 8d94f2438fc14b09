"""Starting over and resuming with other settings: output.resume=false loses nothing until the new rows are
written; a resumed run names every setting that changed; a sweep swept again into its own directory with
other values is refused before it runs (its job directories are numbered by position)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from ladle.runner.config import ConfigError, to_job_config
from ladle.runner.executors.local import Local
from ladle.runner.executors.replica import replica_cfg
from ladle.runner.executors.replica_files import merge_replicas, replica_dir
from ladle.runner.job import run_job
from ladle.runner.resume import check_sweep_resume, config_args, config_changes, resume_command
from ladle.runner.sources import open_source
from ladle.runner.sources.shard import Routing, Shard
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
    old = "seed: 0\nchunking:\n  size: 16\nworkload:\n  limit: 3\n  batch_size: 8\noutput:\n  plots: true\n"
    same = "seed: 0\nchunking:\n  size: 16\nworkload:\n  limit: 9\n  batch_size: 2\noutput:\n  plots: false\n"
    assert config_changes(old, same) == {}
    assert config_changes(None, old) == {}
    other = same.replace("size: 16", "size: 64").replace("seed: 0", "seed: 3")
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


def test_settings_only_one_config_has_are_no_change():
    """A key added to ladle's config since the rows were written (at its default) is not a user's change."""
    old = "chunking:\n  size: 16\n"
    assert config_changes(old, "chunking:\n  size: 16\nmodel:\n  cuda_graphs: true\n") == {}


def test_a_sweep_job_is_refused_only_for_a_setting_its_command_line_gives(tmp_path):
    src = parquet(tmp_path / "p.parquet", ["a", "b"])
    out = tmp_path / "out"
    base = ["workload=parquet", f"workload.path={src}", "chunking.size=16"]
    run_job(compose_cfg(*base), out, engine=FakeEngine())
    moved = parquet(tmp_path / "moved.parquet", ["a", "b"])  # the checkout moved: its data path with it
    again = OmegaConf.to_yaml(compose_cfg("workload=parquet", f"workload.path={moved}", "chunking.size=16"),
                              resolve=True)
    check_sweep_resume(out, again, True, ["chunking.size=16"])  # the path is no override here: a warning only
    other = OmegaConf.to_yaml(compose_cfg(*base[:2], "chunking.size=64"), resolve=True)
    with pytest.raises(ConfigError, match="chunking.size: 16 -> 64"):
        check_sweep_resume(out, other, True, ["chunking.size=64"])
    check_sweep_resume(out, other, False, ["chunking.size=64"])  # starting over: nothing to mix


def test_an_executor_ray_sweep_job_resumes_with_its_own_command(tmp_path):
    """The merged generations.parquet held the replicas' config (executor.kind=local, their threads), so
    every resume of an executor=ray sweep job was refused; it now holds the run's own."""
    src = parquet(tmp_path / "p.parquet", ["a", "b", "c", "d"])
    overrides = ["workload=parquet", f"workload.path={src}", "executor=ray", "executor.num_replicas=1",
                 "executor.batch_size=2"]
    cfg = compose_cfg(*overrides)
    job, out = to_job_config(cfg), tmp_path / "sweep" / "0"
    rcfg = replica_cfg(cfg)
    routing = Routing(job.executor.num_replicas, job.executor.batch_size)
    d = replica_dir(out, 0)
    d.mkdir(parents=True)
    shard = Shard(0, routing, None, None, None, d / ".crashed")
    Local(engine=FakeEngine(), source=open_source(to_job_config(rcfg).workload, shard)).run(rcfg, d)
    merge_replicas(out, job, 1, OmegaConf.to_yaml(cfg, resolve=True))
    assert pq.read_table(out / "generations.parquet").num_rows == 4
    check_sweep_resume(out, OmegaConf.to_yaml(cfg, resolve=True), True, overrides)


def test_the_printed_resume_command_resumes():
    """After output.resume=false and Ctrl-C, the printed command carried output.resume=false: it started over."""
    cmd = resume_command(Path("/runs/x"), ["output.resume=false", "chunking.size=64", "+output.resume=False"])
    assert "output.resume" not in cmd and "chunking.size=64" in cmd


def test_the_resume_command_keeps_the_config_tree_the_run_was_composed_from(tmp_path):
    """A user's --config-dir (made absolute), --config-name and hydra.searchpath go into the command;
    the shipped tree (the package's own source, the main config name) and other hydra overrides do not."""
    class Source:
        def __init__(self, path: str, provider: str) -> None:
            self.path, self.provider = path, provider

    sources = [Source("pkg://hydra.conf", "hydra"), Source("file:///pkg/ladle/conf", "main"),
               Source(f"file://{tmp_path}/myconf", "command-line")]
    args = config_args(sources, "mysweep", ["hydra.searchpath=[file:///extra]", "hydra.verbose=true"])
    assert args == ["--config-dir", str(tmp_path / "myconf"), "--config-name", "mysweep",
                    "hydra.searchpath=[file:///extra]"]
    assert config_args(sources[:2], "config", ["hydra.job.chdir=false"]) == []
    cmd = resume_command(tmp_path / "run", ["model=mine"], args)
    assert cmd.split()[3:6] == ["--config-dir", str(tmp_path / "myconf"), "--config-name"]
