"""`python -m ladle` as a user runs it: default config, multirun + sweep report, resume, config errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tests.runner.conftest import check_run

FAST = ["sampling.max_tokens=3", "output.progress=false", "max_num_seqs=4", "cache.max_model_len=512"]


ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "ladle" / "runner" / "data" / "prompts.parquet"  # the sample workload's file


def ladle(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    # PYTHONPATH: this checkout's packages, whatever checkout an editable install points at
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ladle", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_default_config(tmp_path):
    """The default config (tiny model, sample prompts), run from a directory that is not the repo."""
    out = tmp_path / "run"
    p = ladle(f"hydra.run.dir={out}", "workload.limit=4", *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ladle summary" in p.stdout and "TTFT" in p.stdout and f"outputs in {out}" in p.stdout
    # ladle's warnings are one clean line each, without Python's source line under them
    warned = [line for line in p.stderr.splitlines() if "RANDOM" in line]
    assert warned == [("ladle: warning: model weights are RANDOM (Qwen3ForCausalLM, 0.85M parameters, seed 0): "
                       "model.path is null. Outputs are meaningless; timings are real.")], p.stderr[-2000:]
    assert "load_model(" not in p.stderr and "RandomWeightsWarning" not in p.stderr
    run = check_run(out)
    assert len(run["rows"]) == 4 and all(r["id"].startswith("sample-") for r in run["rows"])
    assert all(r["prompt"] for r in run["rows"])
    for name in ("schedule.png", "latency.png", "summary.json", ".hydra/config.yaml"):
        assert (out / name).exists(), name
    meta = pq.read_schema(out / "generations.parquet").metadata[b"ladle.config"].decode()
    assert "workload:" in meta and "prompts.parquet" in meta  # resolved config, interpolations resolved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny" and summary["overrides"][0] == "workload.limit=4"



def _interrupt_when_rows_are_written(cmd: list[str], cwd: Path, tmp: Path) -> tuple[int, str, str]:
    """Run `cmd`, send it SIGINT once `tmp` (a generations.parquet.tmp) holds a few row groups; (exit
    status, stdout, stderr)."""
    import signal
    import time

    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))
    # a suite started in the background (`pytest &`) has SIGINT ignored, and a child inherits that: hand it
    # a handled SIGINT instead (exec resets a handler to the default), as a terminal's Ctrl-C finds it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if tmp.exists() and tmp.stat().st_size > 3000:  # a few row groups are on disk
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def test_the_resume_command_of_an_interrupted_sweep_resumes_the_sweep(tmp_path):
    """Ctrl-C in a multirun's first job: the printed command is the sweep's own (--multirun, the swept
    values, the sweep directory), so running it finishes the first job and runs the second, which the
    interrupted sweep never started."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "ladle", "--multirun", "chunking.size=16,64", f"hydra.sweep.dir={sweep}",
           "output.row_group_size=1", "max_num_seqs=2", "sampling.max_tokens=32", "sampling.ignore_eos=true",
           "output.progress=false", "output.plots=false", "cache.max_model_len=512"]
    code, stdout, stderr = _interrupt_when_rows_are_written(cmd, tmp_path, sweep / "0" / "generations.parquet.tmp")
    said = stdout + stderr
    assert code == 130, said[-3000:]
    assert not (sweep / "1").exists()
    command = re.search(r"to resume, run: (.*)", said)[1].strip()
    resume = shlex.split(command)
    assert resume[3:7] == [sys.executable, "-m", "ladle", "--multirun"] and "chunking.size=16,64" in resume
    assert f"hydra.sweep.dir='{sweep}'" in resume
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, shell=True, cwd=sweep, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for job in ("0", "1"):
        assert pq.read_table(sweep / job / "generations.parquet").num_rows == 48
        assert json.loads((sweep / job / "summary.json").read_text())["complete"] is True
    assert pq.read_table(sweep / "sweep.parquet").num_rows == 2


def test_a_sweep_with_job_chdir_shares_its_calibration_at_the_sweep_root(tmp_path):
    """hydra.job.chdir=true runs each job inside its own directory: a relative hydra.sweep.dir still names
    the sweep root where the run started, so the jobs share one arrival calibration (the sample workload's
    documents arrive at a load) and replay the same arrivals."""
    p = ladle("--multirun", "chunking.size=16,64", "hydra.sweep.dir=sweep", "hydra.job.chdir=true",
              "workload.limit=4", "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    sweep = tmp_path / "sweep"
    assert (sweep / "calibration.json").exists() and not (sweep / "0" / "sweep").exists()
    calibrations = [json.loads((sweep / job / "summary.json").read_text())["arrival_calibration"]
                    for job in ("0", "1")]
    assert calibrations[0] == calibrations[1]

def test_multirun_sweep_report(tmp_path):
    sweep = tmp_path / "sweep"
    p = ladle("--multirun", "chunking.size=16,64", f"hydra.sweep.dir={sweep}", "workload.limit=3",
              "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    t = pq.read_table(sweep / "sweep.parquet").to_pylist()
    assert [r["varied"] for r in t] == ["chunking.size=16", "chunking.size=64"]
    assert all("workload.limit=3" in r["overrides"] for r in t)
    for r in t:
        assert r["requests"] == 3 and r["errors"] == 0
        assert r["ttft_p50_ms"] > 0 and r["itl_p99_ms"] > 0 and r["output_tok_per_s"] > 0
    md = (sweep / "sweep.md").read_text()
    assert "chunking.size=16" in md and "TTFT p50 ms" in md and "ITL p99 ms" in md
    assert (sweep / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    for i in (0, 1):
        check_run(sweep / str(i))


def test_ctrl_c_leaves_readable_outputs(tmp_path):
    """SIGINT mid-run: exit 130, generations.parquet finalised with the rows written so far, no .tmp."""
    out = tmp_path / "run"
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))
    # a user's own model config (--config-dir, relative): the resume command must find it again
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    tiny = (ROOT / "ladle" / "conf" / "model" / "tiny.yaml").read_text()
    (tmp_path / "myconf" / "model" / "mine.yaml").write_text(tiny.replace("name: tiny", "name: mine"))
    # and a relative workload.path: the resume command runs from where the run started
    (tmp_path / "prompts.parquet").write_bytes(PROMPTS.read_bytes())
    cmd = [sys.executable, "-m", "ladle", "--config-dir", "myconf", "model=mine", "workload.path=prompts.parquet",
           f"hydra.run.dir={out}", "output.row_group_size=1", "max_num_seqs=2",
           "sampling.max_tokens=32", "sampling.ignore_eos=true", "output.progress=false", "cache.max_model_len=512"]
    returncode, stdout, stderr = _interrupt_when_rows_are_written(cmd, tmp_path, out / "generations.parquet.tmp")
    assert returncode == 130, stderr[-3000:]
    rows = pq.read_table(out / "generations.parquet").to_pylist()
    assert 0 < len(rows) < 48 and not list(out.glob("*.tmp"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False
    # The message counts the rows really on disk and gives the exact command that resumes.
    said = re.search(r"interrupted: (\d+) requests written by this run, (\d+) in \S+ in all; to resume, run: (.*)",
                     stdout + stderr)
    assert said and int(said[1]) == int(said[2]) == len(rows), stdout + stderr
    assert "INCOMPLETE" in stdout and f"resume with: {summary['resume_command']}" in stdout
    resume = shlex.split(said[3].strip())
    assert resume[:3] == ["cd", str(tmp_path), "&&"]
    assert resume[3:6] == [sys.executable, "-m", "ladle"] and f"hydra.run.dir='{out}'" in resume
    assert "sampling.max_tokens=32" in resume and "max_num_seqs=2" in resume and "model=mine" in resume
    assert resume[6:8] == ["--config-dir", str(tmp_path / "myconf")]
    # from another directory, through a shell as a user pastes it
    done = subprocess.run(said[3].strip(), shell=True, cwd=out, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert pq.read_table(out / "generations.parquet").num_rows == 48
    assert json.loads((out / "summary.json").read_text())["complete"] is True


def test_config_error_exits_2_naming_the_key(tmp_path):
    p = ladle("workload=parquet", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert p.returncode == 2 and "workload.path" in p.stderr


def test_every_config_error_exits_2_with_one_message(tmp_path):
    """Hydra's own composition errors and ladle's checks alike: exit 2, the problem said once."""
    cases = {
        "chunking.sise=3": "sise",  # unknown key (Hydra)
        "model=nope": "model/nope",  # unknown group option (Hydra)
        "chunking.size=0": "chunking.size=0",  # a value ladle checks
        "model.path=/no/such/modles/dir": "/no/such/modles/dir",  # a typo in model.path
    }
    for override, needle in cases.items():
        p = ladle(f"hydra.run.dir={tmp_path / 'r'}", override, *FAST, timeout=120, cwd=tmp_path)
        assert p.returncode == 2, (override, p.returncode, p.stderr[-2000:])
        out = p.stdout + p.stderr
        assert needle in out and "Traceback" not in out, (override, out)
        # One message: Hydra's (which ends with its HYDRA_FULL_ERROR hint) or ladle's, never both or twice.
        assert out.count("HYDRA_FULL_ERROR=1") + out.count("ladle: config error") == 1, (override, out)


def test_a_preset_whose_weights_are_not_cached_says_how_to_choose(tmp_path):
    env_cache = tmp_path / "empty-hf-cache"
    env = dict(os.environ, HYDRA_FULL_ERROR="0", HF_HUB_CACHE=str(env_cache), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "ladle", "model=qwen3_0_6b", f"hydra.run.dir={tmp_path / 'r'}",
                        *FAST], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2
    err = [line for line in p.stderr.splitlines() if line.startswith("ladle: config error")]
    assert len(err) == 1 and "Qwen/Qwen3-0.6B" in err[0] and "model.random_weights=true" in err[0]
    assert str(env_cache) in err[0]
    assert not (tmp_path / "r" / "generations.parquet").exists()


def test_only_ladles_own_warnings_lose_their_source_line(monkeypatch):
    import io
    import warnings

    from ladle.models.loader import RandomWeightsWarning
    from ladle.runner.cli_warnings import PACKAGE_DIR, install

    passed_on = []  # what reaches the showwarning in place before (Python's own, outside pytest)
    monkeypatch.setattr(warnings, "showwarning", lambda *args: passed_on.append(args))
    install()
    install()  # idempotent
    buf = io.StringIO()
    warnings.showwarning(RandomWeightsWarning("weights"), RandomWeightsWarning, "/elsewhere/x.py", 3, buf)
    warnings.showwarning(UserWarning("ours"), UserWarning, str(PACKAGE_DIR / "engine" / "kv_cache.py"), 9, buf)
    theirs = (UserWarning("theirs"), UserWarning, "/site-packages/torch/nn/x.py", 7, buf, "x = 1")
    warnings.showwarning(*theirs)
    assert buf.getvalue().splitlines() == ["ladle: warning: weights", "ladle: warning: ours"]
    assert passed_on == [theirs]


FAILED_JOB_SCRIPT = """
import gc, sys, weakref
from pathlib import Path
import ladle.runner.job
from ladle.runner import cli

marker, sweep = Path(sys.argv[1]), sys.argv[2]
engines = []

class Engine:  # stands for the job's engine: its weights and KV cache
    pass

class Result:
    interrupted = False

def run_job(cfg, out_dir, extra=None, calibration_path=None):
    engine = Engine()
    engines.append(weakref.ref(engine))
    if len(engines) == 1:
        raise RuntimeError("the first job failed after building its engine")
    gc.collect()
    marker.write_text("collected" if engines[0]() is None else "alive")
    return Result()

ladle.runner.job.run_job = run_job
sys.argv = ["ladle", "--multirun", "chunking.size=16,64", f"hydra.sweep.dir={sweep}", "output.plots=false"]
cli.main()
"""


def test_a_failed_multirun_job_does_not_keep_its_engine_through_the_later_jobs(tmp_path):
    """Hydra keeps a failed job's exception until the sweep ends; its traceback's frames held the job's
    engine (on a GPU, most of its memory) through every later job. The CLI drops those frames' locals and
    re-raises: the later job runs with the engine gone, and Hydra still reports the failure with its traceback."""
    marker = tmp_path / "second_job_saw"
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", FAILED_JOB_SCRIPT, str(marker), str(tmp_path / "sweep")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240, check=False)
    assert marker.read_text() == "collected", p.stderr[-3000:]
    assert p.returncode != 0 and "the first job failed after building its engine" in p.stderr, p.stderr[-3000:]
    assert "in run_job" in p.stderr  # the traceback's frames are still named


def test_a_sweep_that_stops_at_a_failed_job_still_reports_the_runs_that_finished(tmp_path):
    """Hydra skips its end-of-sweep callbacks when a job fails, so the sweep report was lost with every run
    that had finished; the CLI writes it of those runs, then exits as the failed job did."""
    sweep = tmp_path / "sweep"
    # A missing file is found when the job opens it (its config alone is valid: the sweep's check passes).
    p = ladle("--multirun", f"workload.path={PROMPTS},{tmp_path / 'missing.parquet'}", "workload.limit=3",
              f"hydra.sweep.dir={sweep}", "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr, p.stderr[-3000:]
    assert "the sweep ended with a failed or interrupted job" in p.stderr and str(sweep.resolve()) in p.stderr, \
        p.stderr[-3000:]
    rows = pq.read_table(sweep / "sweep.parquet").to_pylist()
    assert [r["requests"] for r in rows] == [3] and f"workload.path={PROMPTS}" in rows[0]["overrides"]
    assert "prompts.parquet" in (sweep / "sweep.md").read_text()


def test_a_sweep_with_an_invalid_point_runs_none_of_its_jobs(tmp_path):
    """Each job's config used to be checked only when that job started: chunking.size=16 ran whole (model
    loaded, dataset read), then 0 stopped the sweep and 64 never ran."""
    sweep = tmp_path / "sweep"
    p = ladle("--multirun", "chunking.size=16,0,64", "workload.limit=3", f"hydra.sweep.dir={sweep}",
              "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "job 1 (chunking.size=0 workload.limit=3" in p.stderr and "chunking.size=0 is invalid" in p.stderr, \
        p.stderr[-3000:]
    assert not (sweep / "0").exists() and "ladle summary" not in p.stdout


def test_a_failed_sweep_in_a_reused_directory_reports_nothing_when_none_of_its_jobs_finished(tmp_path):
    """A sweep directory reused from an earlier sweep holds that sweep's summaries: a sweep whose first job
    fails must not report (and overwrite the report of) the earlier runs as its own."""
    sweep = tmp_path / "sweep"
    (sweep / "old").mkdir(parents=True)
    (sweep / "old" / "summary.json").write_text(json.dumps({"overrides": ["workload.limit=5"], "requests": 5}))
    (sweep / "sweep.md").write_text("the earlier sweep's report\n")
    p = ladle("--multirun", f"workload.path={tmp_path / 'missing.parquet'},{PROMPTS}", f"hydra.sweep.dir={sweep}",
              "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr, p.stderr[-3000:]
    assert "the sweep ended" not in p.stderr, p.stderr[-3000:]
    assert (sweep / "sweep.md").read_text() == "the earlier sweep's report\n"


def test_release_frames_reaches_causes_contexts_and_exception_group_members():
    import gc
    import weakref

    from ladle.runner.cli import release_frames

    class Held:  # stands for an engine a failed job's frame held
        pass

    held: list[weakref.ref] = []

    def fail(kind: str) -> None:
        engine = Held()
        held.append(weakref.ref(engine))
        raise ValueError(kind)

    def fail_twice() -> None:
        errors = []
        for kind in ("a", "b"):
            try:
                fail(kind)
            except ValueError as e:
                errors.append(e)
        try:
            fail("context")
        except ValueError:
            raise ExceptionGroup("both", errors) from RuntimeError("cause")

    try:
        fail_twice()
    except ExceptionGroup as e:
        error = e
    release_frames(error)
    gc.collect()
    assert len(held) == 3 and all(ref() is None for ref in held)
    assert [str(x) for x in error.exceptions] == ["a", "b"]  # the exceptions themselves are kept

    class NotAGroup(Exception):
        exceptions = 3  # an attribute of that name on another exception is not walked

    release_frames(NotAGroup())


def test_the_sweep_check_expands_glob_sweeps_too(tmp_path):
    """glob(...) needs Hydra's config loader to list a group's options: without it the check raised (a raw
    UserWarning), was skipped, and the sweep ran its first job before failing."""
    p = ladle("--multirun", "workload=glob(s*)", "chunking.size=16,0", f"hydra.sweep.dir={tmp_path / 'sweep'}",
              "output.plots=false", *FAST, cwd=tmp_path)
    assert p.returncode == 2 and "2 job(s) of this sweep" in p.stderr, p.stderr[-3000:]
    assert "UserWarning" not in p.stderr and "ladle summary" not in p.stdout
