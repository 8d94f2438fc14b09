"""Resume (runner/resume.py): what a run with other settings does, and which rows count as done.

Starting over and resuming with other settings: output.resume=false loses nothing until the new rows are
written; a resumed run names every setting that changed; a sweep swept again into its own directory with
other values is refused before it runs (its job directories are numbered by position).

Resume's notion of "done" is one function, `ResumeState.progress`: a test per case.

A row is done when all n of its samples were written (a sample's error row counts as written), or when
its one row is the error of the whole request (sample 0, no token: it failed before its prompt forked
into samples). A repeated id's row, and a row with no id of its own, is done when its error row (found
by id and row index) was written.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from ladle.runner.config import CONF_DIR, ConfigError, OutputConfig, to_job_config
from ladle.runner.executors.local import Local
from ladle.runner.executors.replica import replica_cfg
from ladle.runner.executors.replica_files import merge_replicas, replica_dir
from ladle.runner.job import run_job
from ladle.runner.resume import (
    Progress,
    ResumeState,
    check_sweep_resume,
    config_args,
    config_changes,
    resume_command,
)
from ladle.runner.sinks import generations_schema
from ladle.runner.sources import open_source
from ladle.runner.sources.rows import duplicate_id_error
from ladle.runner.sources.shard import Routing, Shard
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine
from tests.runner.test_cli import FAST, ladle
from tests.runner.test_job import InterruptAfter, parquet


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


def test_the_resume_command_runs_from_where_the_run_started():
    """Relative paths in the overrides mean what they meant: the command changes to the run's starting
    directory first (shell-quoted: a space in it stays one word)."""
    import shlex

    cmd = resume_command(Path("/runs/x"), ["workload.path=data/p.parquet"], cwd="/home/me/my project")
    assert shlex.split(cmd)[:4] == ["cd", "/home/me/my project", "&&", sys.executable]
    assert resume_command(Path("/runs/x"), []).split()[0] == sys.executable  # no starting directory: none


def row(rid, index, k=0, error=None, tokens=1):
    return {"id": rid, "index": index, "sample_index": k, "finish_reason": "error" if error else "length",
            "error": error, "output_tokens": tokens}


def state(tmp_path, rows, **output) -> ResumeState:
    path = tmp_path / "generations.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=generations_schema(True)), path)
    return ResumeState.read(path, tmp_path / "steps.parquet", OutputConfig(**output))


def test_all_samples_written(tmp_path):
    s = state(tmp_path, [row("a", 0, k) for k in range(3)])
    assert s.progress("a", 0, 3, False) == Progress(True, frozenset({0, 1, 2}))
    assert s.progress("a", 0, 2, False).done  # a lower n later: still all written
    assert not s.progress("a", 0, 4, False).done


def test_some_samples_written_runs_only_the_others(tmp_path):
    s = state(tmp_path, [row("a", 0, 0), row("a", 0, 2)])
    assert s.progress("a", 0, 3, False) == Progress(False, frozenset({0, 2}))
    assert s.progress("b", 1, 3, False) == Progress(False, frozenset())  # nothing written


def test_an_error_row_for_the_whole_request_before_the_fork_is_done_whatever_n(tmp_path):
    s = state(tmp_path, [row("a", 0, 0, error="prompt too long", tokens=0)])
    for n in (1, 3, 1024):
        assert s.progress("a", 0, n, False) == Progress(True, frozenset())


def test_error_rows_per_sample_after_the_fork_count_for_their_sample_only(tmp_path):
    s = state(tmp_path, [row("a", 0, 0), row("a", 0, 1, error="step failed", tokens=2)])
    assert s.progress("a", 0, 3, False) == Progress(False, frozenset({0, 1}))
    # sample 0 failing after the fork drew its first token: its lone error row is its own
    s = state(tmp_path, [row("b", 0, 0, error="step failed", tokens=1)])
    assert s.progress("b", 0, 3, False) == Progress(False, frozenset({0}))


def test_repeated_ids_are_told_apart_by_row_index(tmp_path):
    dup = duplicate_id_error("x", "key")
    s = state(tmp_path, [row("x", 2, 0, error=dup, tokens=0), row("x", 0, 0), row("y", 1, 0)])
    assert s.progress("x", 2, 3, True) == Progress(True, frozenset())  # the repeat: its error row is there
    assert s.progress("x", 4, 3, True) == Progress(False, frozenset())  # another repeat, not written yet
    # the id's own row: the repeat's error row never makes it look done, nor counts as its sample 0
    assert s.progress("x", 0, 1, False) == Progress(True, frozenset({0}))
    assert s.progress("x", 0, 2, False) == Progress(False, frozenset({0}))


def test_rows_without_an_id_of_their_own_are_told_apart_by_row_index(tmp_path):
    s = state(tmp_path, [row(None, 3, 0, error="line 4 is not valid JSON", tokens=0),
                         row(None, 5, 0, error="line 6 has no custom_id", tokens=0)])
    assert s.progress(None, 3, 1, False).done and s.progress(None, 5, 1, False).done
    assert not s.progress(None, 4, 1, False).done


def test_retry_errors_and_no_resume(tmp_path):
    rows = [row("a", 0, 0, error="boom", tokens=0), row("b", 1, 0)]
    assert not state(tmp_path, rows, retry_errors=True).progress("a", 0, 1, False).done
    assert state(tmp_path, rows, retry_errors=True).progress("b", 1, 1, False).done
    assert not state(tmp_path, rows, resume=False).progress("b", 1, 1, False).done


class FailSampleZeroTokenless:
    """Sample 0 of every request fails right after the fork with no token in its output (the ambiguous
    case: a whole request failing before its fork looks the same); Ctrl-C arrives during step
    `interrupt_at` (None: never)."""

    def __init__(self, eng, interrupt_at=None):
        self.eng, self.interrupt_at, self.steps = eng, interrupt_at, 0

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        self.steps += 1
        if self.interrupt_at is not None and self.steps >= self.interrupt_at:
            raise KeyboardInterrupt
        outs = []
        for o in self.eng.step():
            if o.sample_index == 0 and o.finish_reason != "error":
                self.eng.running = [r for r in self.eng.running if not (r.id == o.request_id and r.sample_index == 0)]
                o = dataclasses.replace(o, output_token_ids=[], text="", finished=True, finish_reason="error",
                                        error="sample failed")
            outs.append(o)
        return outs


def rows_of(out):
    return sorted((r["id"], r["sample_index"], r["error"]) for r in pq.read_table(out / "generations.parquet").to_pylist())


@pytest.fixture
def n3(tmp_path):
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["aa", "bb"]}), src)
    return compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.max_tokens=6")


def test_a_tokenless_failure_of_sample_0_after_the_fork_then_a_crash_never_skips_its_siblings(tmp_path, n3):
    """Sample 0's error row was written at once; the run stopped before its siblings finished; resume took
    the lone tokenless sample-0 error for a failure before the fork (all n done) and never ran them."""
    out = tmp_path / "out"
    first = run_job(n3, out, engine=FailSampleZeroTokenless(FakeEngine(), interrupt_at=4))
    assert first.interrupted
    run_job(n3, out, engine=FakeEngine())
    got = rows_of(out)
    assert [(rid, k) for rid, k, _ in got] == [(i, k) for i in ("0", "1") for k in range(3)], got


def test_a_tokenless_failure_of_sample_0_after_the_fork_is_written_once_its_siblings_are(tmp_path, n3):
    out = tmp_path / "out"
    res = run_job(n3, out, engine=FailSampleZeroTokenless(FakeEngine()))
    assert rows_of(out) == [(i, k, "sample failed" if k == 0 else None) for i in ("0", "1") for k in range(3)]
    assert res.summary["samples"] == 6
    again = run_job(n3, out, engine=FakeEngine())  # complete: nothing runs again
    assert again.summary["resumed"] == 2 and len(rows_of(out)) == 6


def test_a_request_the_engine_rejects_before_it_ever_runs_is_written_at_once(tmp_path):
    """The unambiguous case needs no waiting: a request never scheduled cannot have forked."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["y" * 100, "ok"]}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3")
    out = tmp_path / "out"
    first = run_job(cfg, out, engine=InterruptAfter(FakeEngine(max_model_len=64), 1))
    assert first.interrupted and rows_of(out) == [("0", 0, rows_of(out)[0][2])] and rows_of(out)[0][2]
    run_job(cfg, out, engine=FakeEngine(max_model_len=64))
    assert [(rid, k) for rid, k, _ in rows_of(out)] == [("0", 0), ("1", 0), ("1", 1), ("1", 2)]


def test_the_resume_command_keeps_the_config_tree_the_run_was_composed_from(tmp_path):
    """A user's --config-dir (made absolute), --config-name and hydra.searchpath go into the command;
    the shipped tree (the package's own source, the main config name) and other hydra overrides do not.
    The sources are as Hydra records them: a path without its scheme, the scheme apart."""
    class Source:
        def __init__(self, path: str, schema: str, provider: str) -> None:
            self.path, self.schema, self.provider = path, schema, provider

    sources = [Source("hydra.conf", "pkg", "hydra"), Source(str(CONF_DIR), "file", "main"),
               Source(f"{tmp_path}/myconf", "file", "command-line"),
               Source("/extra", "file", "hydra.searchpath in command-line"),
               Source("my_pkg.conf", "pkg", "hydra.searchpath in command-line"),
               Source("", "structured", "schema")]
    args = config_args(sources, "mysweep", ["hydra.searchpath=[file:///extra,pkg://my_pkg.conf]",
                                            "hydra.verbose=true"])
    assert args == ["--config-dir", str(tmp_path / "myconf"), "--config-name", "mysweep",
                    "hydra.searchpath=['file:///extra','pkg://my_pkg.conf']"]
    assert config_args(sources[:2], "config", ["hydra.job.chdir=false"]) == []
    cmd = resume_command(tmp_path / "run", ["model=mine"], args)
    assert cmd.split()[3:6] == ["--config-dir", str(tmp_path / "myconf"), "--config-name"]


# A Hydra app composed as ladle's CLI composes (the shipped tree as its primary config path) that prints the
# config_args of its run and the model it composed: run again with those args from another directory, it
# must compose the same model.
CONFIG_TREE_APP = """
import json
import hydra
from hydra.core.hydra_config import HydraConfig
from ladle.runner.config import CONF_DIR, register_configs
from ladle.runner.resume import config_args

register_configs()

@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg):
    hc = HydraConfig.get()
    args = config_args(hc.runtime.config_sources, hc.job.config_name, hc.overrides.hydra, hc.runtime.cwd)
    print(json.dumps({"args": args, "model": cfg.model.name}))

main()
"""


def _compose(app: Path, args: list[str], cwd: Path) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, str(app), *args, "hydra.output_subdir=null", f"hydra.run.dir={cwd}/run"],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["config-path", "relative searchpath", "searchpath with a space"])
def test_the_resume_arguments_compose_the_same_config_from_another_directory(tmp_path, how):
    """The arguments that chose the run's config tree, as Hydra recorded them, compose the same config when
    given again from another directory: a user's own primary config (--config-path: without it the resumed
    run composes the shipped tree), and hydra.searchpath entries relative to where the run started (or with
    a space in their path)."""
    app = tmp_path / "app.py"
    app.write_text(CONFIG_TREE_APP)
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny = (Path(__file__).resolve().parents[2] / "ladle" / "conf" / "model" / "tiny.yaml").read_text()
    folder = "my conf" if how == "searchpath with a space" else "myconf"
    (start / folder / "model").mkdir(parents=True)
    (start / folder / "model" / "mine.yaml").write_text(tiny.replace("name: tiny", "name: mine"))
    if how == "config-path":
        (start / folder / "own.yaml").write_text("defaults:\n  - model: mine\n  - _self_\n")
        given = ["--config-path", str(start / folder), "--config-name", "own"]
    else:
        given = ["hydra.searchpath=['file://" + folder + "']", "model=mine"]
    first = _compose(app, given, start)
    assert first["model"] == "mine"
    task = [a for a in given if a.startswith("model=")]
    again = _compose(app, [*first["args"], *task], elsewhere)
    assert again == first
