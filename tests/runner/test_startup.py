"""The CLI's start-up step (runner/startup.py): the environment it computes, the one re-exec, the opt-out,
the user's own settings, a missing tcmalloc, and a real `python -m ladle` running with the settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ladle.runner import startup
from ladle.runner.startup import MARKER, SWITCH, Plan, find_malloc, mapped, plan, prepare, runtime_info

ROOT = Path(__file__).resolve().parents[2]
TC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@pytest.fixture(autouse=True)
def _step_not_applied(monkeypatch):
    """prepare() marks the process as set up (summary.json's startup_step): keep that to each test."""
    monkeypatch.setattr(startup, "_applied", False)


class FakeExec:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []

    def __call__(self, path: str, argv: list[str], env) -> None:
        self.calls.append((path, argv, dict(env)))


def run_prepare(env: dict[str, str], malloc: Path | None = TC, maps: Path = Path("/nonexistent")):
    said: list[str] = []
    fake = FakeExec()
    p = prepare(argv=["python", "-m", "runner", "x=1"], environ=env, execve=fake, malloc=malloc,
                torch_loaded=False, maps=maps, say=said.append)
    return p, fake.calls, said


def test_fresh_environment_sets_openmp_and_preloads_tcmalloc():
    p = plan({}, TC, platform="linux")
    assert p.reexec
    assert p.env["OMP_WAIT_POLICY"] == "PASSIVE" and p.env["GOMP_SPINCOUNT"] == "1000" and p.env["LD_PRELOAD"] == str(TC)
    assert p.env[MARKER].split("|") == p.notes  # the re-executed process reports the parent's words
    assert p.notes == ["OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000", f"tcmalloc preloaded ({TC})"]


def test_prepare_reexecutes_once_with_the_same_command_line():
    env: dict[str, str] = {"PATH": "/bin"}
    _p, calls, said = run_prepare(env)
    assert len(calls) == 1 and said == []  # the line is printed by the re-executed process
    path, argv, child_env = calls[0]
    assert path == sys.executable and argv == ["python", "-m", "runner", "x=1"]
    assert child_env["LD_PRELOAD"] == str(TC) and child_env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert child_env["GOMP_SPINCOUNT"] == "1000"
    assert child_env["PATH"] == "/bin" and MARKER in child_env
    # the re-executed process starts with that environment: it must not execute itself again
    p2, calls2, said2 = run_prepare(dict(child_env), maps=_maps_with(TC))
    assert calls2 == [] and not p2.reexec and p2.env == {}
    assert said2 == [f"ladle: runtime: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000; tcmalloc preloaded ({TC})"]


def _maps_with(lib: Path) -> Path:
    """A fake /proc/self/maps with `lib` mapped."""
    f = Path(tempfile.mkdtemp()) / "maps"
    f.write_text(f"7f00-7f10 r-xp 00000000 08:01 123 {lib}\n7f20-7f30 rw-p 00000000 00:00 0 [heap]\n")
    return f


def test_marker_with_a_failed_preload_says_glibc():
    env = {MARKER: f"OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000|tcmalloc preloaded ({TC})", "LD_PRELOAD": str(TC)}
    _p, calls, said = run_prepare(env, maps=_maps_with(Path("/usr/lib/libc.so.6")))
    assert calls == [] and said[0].startswith("ladle: runtime: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000; glibc malloc (tcmalloc")


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_opt_out_does_nothing(value):
    env = {SWITCH: value}
    p, calls, said = run_prepare(env)
    assert calls == [] and said == [] and env == {SWITCH: value} and p.env == {} and not p.reexec


def test_users_own_settings_are_kept():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "LD_PRELOAD": "/opt/libjemalloc.so.2"}
    p, calls, said = run_prepare(env)
    assert calls == [] and p.env == {}
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "LD_PRELOAD": "/opt/libjemalloc.so.2"}
    assert said == ["ladle: runtime: OMP_WAIT_POLICY=ACTIVE (yours); LD_PRELOAD=/opt/libjemalloc.so.2 (yours)"]


def test_users_wait_policy_alone_gets_no_spin_count_added():
    """PASSIVE set by the user means sleep at once: a spin count added by ladle would override it."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", "LD_PRELOAD": "/opt/libjemalloc.so.2"}
    p, calls, said = run_prepare(env)
    assert calls == [] and p.env == {} and "GOMP_SPINCOUNT" not in env
    assert said == ["ladle: runtime: OMP_WAIT_POLICY=PASSIVE (yours); LD_PRELOAD=/opt/libjemalloc.so.2 (yours)"]


def test_users_spin_count_keeps_the_wait_policy_theirs():
    env = {"GOMP_SPINCOUNT": "100000", "LD_PRELOAD": "/opt/libjemalloc.so.2"}
    p, calls, said = run_prepare(env)
    assert calls == [] and "OMP_WAIT_POLICY" not in env and p.env == {}
    assert said == ["ladle: runtime: GOMP_SPINCOUNT=100000 (yours); LD_PRELOAD=/opt/libjemalloc.so.2 (yours)"]


@pytest.mark.parametrize("var,value", [("MALLOC_ARENA_MAX", "2"),
                                       ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1073741824")])
def test_users_glibc_malloc_tuning_is_kept(var, value):
    env = {var: value}
    p, calls, said = run_prepare(env)
    assert calls == [] and "LD_PRELOAD" not in env and not p.reexec
    assert said == [f"ladle: runtime: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000; glibc malloc as you tuned it ({var})"]


def test_unrelated_glibc_tunables_do_not_stop_the_preload():
    p = plan({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, TC, platform="linux")
    assert p.reexec and p.env["LD_PRELOAD"] == str(TC)


def test_without_tcmalloc_it_runs_on_glibc_and_says_how_to_install(monkeypatch):
    monkeypatch.setattr(startup, "find_malloc", lambda dirs=None: None)
    env: dict[str, str] = {}
    _p, calls, said = run_prepare(env, malloc=None)
    assert calls == [] and env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    assert said == [("ladle: runtime: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000; glibc malloc (tcmalloc is not installed: "
                    "apt-get install libtcmalloc-minimal4)")]


def test_not_linux_never_preloads():
    p = plan({}, TC, platform="darwin")
    assert not p.reexec and "LD_PRELOAD" not in p.env and p.env == startup.OMP_ENV


def test_torch_already_imported_changes_nothing():
    env: dict[str, str] = {}
    said: list[str] = []
    fake = FakeExec()
    prepare(argv=["x"], environ=env, execve=fake, malloc=TC, torch_loaded=True, say=said.append)
    assert env == {} and fake.calls == [] and "torch was imported" in said[0]


def test_find_malloc_prefers_the_minimal_build(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert find_malloc([a, b]) is None
    (a / "libtcmalloc.so.4").write_bytes(b"")
    assert find_malloc([a, b]) == a / "libtcmalloc.so.4"
    (b / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_malloc([a, b]) == b / "libtcmalloc_minimal.so.4"


def test_mapped_and_runtime_info(tmp_path):
    maps = _maps_with(TC)
    assert mapped("tcmalloc", maps) and not mapped("jemalloc", maps)
    assert not mapped("tcmalloc", tmp_path / "missing")
    info = runtime_info({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "PATH": "/bin"})
    assert info["omp"] == {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"} and info["startup_step"] == "not run"
    startup._applied = True  # after prepare()
    assert runtime_info({})["startup_step"] == "on"
    assert runtime_info({SWITCH: "0"})["startup_step"] == "off"


def test_plan_line():
    assert Plan(notes=["a", "b"]).line() == "ladle: runtime: a; b"


def _cli(tmp_path: Path, **extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    # the caller's glibc malloc settings (MALLOC_ARENA_MAX is common in containers) would stop the preload
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "LD_PRELOAD", "LADLE_", "MALLOC_", "GLIBC_TUNABLES"))}
    env.update(PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0", **extra)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ladle", f"hydra.run.dir={out}", "workload.limit=1",
                        "sampling.max_tokens=2", "output.progress=false", "output.plots=false", "max_num_seqs=2",
                        "cache.max_model_len=256"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads((out / "summary.json").read_text())["cpu_threads"]["runtime"]


def test_cli_runs_with_the_settings(tmp_path):
    """A real `python -m ladle`: the job itself runs with PASSIVE and (where installed) tcmalloc mapped."""
    p, runtime = _cli(tmp_path)
    lines = [line for line in p.stderr.splitlines() if line.startswith("ladle: runtime:")]
    assert len(lines) == 1, p.stderr[-2000:]  # one line: the process executed itself once, not in a loop
    assert runtime["omp"] == {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "PASSIVE"} and runtime["startup_step"] == "on"
    assert runtime["malloc"] == ("tcmalloc" if find_malloc() else "system"), lines


def test_cli_opt_out(tmp_path):
    p, runtime = _cli(tmp_path, LADLE_STARTUP="0")
    assert "ladle: runtime:" not in p.stderr
    assert runtime == {"malloc": "system", "omp": {}, "startup_step": "off"}


# -- ways the re-exec could break -----------------------------------------------------------------------

def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "LD_PRELOAD", "LADLE_", "MALLOC_", "GLIBC_TUNABLES"))}
    env.update(**extra)
    return env


def test_a_program_read_from_stdin_runs_without_restarting(tmp_path):
    """`python - <<EOF ... main() EOF`: a restart would read the (consumed) stdin again and run nothing,
    exiting 0 without a word; the step must leave the malloc alone there and let the program go on."""
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    fake.write_bytes(b"")  # never loaded: the program must not be restarted at all
    program = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path\n"
               f"from ladle.runner.startup import prepare\nprepare(malloc=Path({str(fake)!r}))\n"
               "print('the job ran', file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-"], input=program, env=_clean_env(), capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 0 and "the job ran" in p.stderr, p.stderr
    assert "cannot be preloaded" not in p.stderr  # no restart happened
    assert "OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000" in p.stderr and "glibc malloc" in p.stderr


def test_a_failed_preload_is_not_passed_on_to_subprocesses():
    """The restarted process found tcmalloc not mapped (wrong architecture, a damaged file): every program
    it starts would print the loader's error again, so LD_PRELOAD leaves its environment."""
    env = {MARKER: f"OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000|tcmalloc preloaded ({TC})", "LD_PRELOAD": str(TC),
           "OMP_WAIT_POLICY": "PASSIVE"}
    _p, calls, said = run_prepare(env, maps=_maps_with(Path("/usr/lib/libc.so.6")))
    assert calls == [] and "glibc malloc (tcmalloc could not be preloaded" in said[0]
    assert "LD_PRELOAD" not in env and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_marker_does_not_reach_subprocesses():
    """The marker is for the restarted process alone: left in the environment, a ladle started by the job
    (a script, a launcher) would print the parent's words whatever its own settings are."""
    env = {MARKER: f"OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000|tcmalloc preloaded ({TC})", "LD_PRELOAD": str(TC),
           "OMP_WAIT_POLICY": "PASSIVE"}
    _p, _calls, said = run_prepare(env, maps=_maps_with(TC))
    assert said == [f"ladle: runtime: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000; tcmalloc preloaded ({TC})"]
    assert MARKER not in env and env["LD_PRELOAD"] == str(TC)
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a ladle the job starts, with a setting of its own
    _p, calls, said = run_prepare(env, maps=_maps_with(TC))
    assert calls == [] and said[0].startswith("ladle: runtime: OMP_WAIT_POLICY=ACTIVE (yours)"), said


def test_a_failed_exec_runs_on_without_the_preload():
    """execve can fail (no usable sys.executable in an embedded interpreter, E2BIG): the job still runs,
    on glibc's malloc, and neither LD_PRELOAD nor the marker is left for its subprocesses."""
    def failing(path, argv, env):
        raise FileNotFoundError(2, "No such file or directory", path)

    env: dict[str, str] = {}
    said: list[str] = []
    p = prepare(argv=["x"], environ=env, execve=failing, malloc=TC, torch_loaded=False,
                maps=Path("/nonexistent"), say=said.append)
    assert not p.reexec and env == startup.OMP_ENV
    assert len(said) == 1 and "glibc malloc (could not restart" in said[0], said


@pytest.mark.parametrize("where", ["/opt/My Envs/lib", "/opt/a:b/lib"])
def test_a_path_the_loader_would_split_is_not_preloaded(where):
    """LD_PRELOAD is split at spaces and colons (no escaping): such a path would preload nothing and make
    every subprocess print the loader's error."""
    p = plan({}, Path(where) / "libtcmalloc_minimal.so.4", platform="linux")
    assert not p.reexec and "LD_PRELOAD" not in p.env and "glibc malloc" in p.notes[-1]


def test_startup_step_is_not_on_when_it_did_not_run(monkeypatch):
    """summary.json's startup_step says whether this process went through the step: a job run through the
    Python API (ladle.runner.job.run_job), or with torch imported first, did not."""
    assert runtime_info({})["startup_step"] == "not run"
    env: dict[str, str] = {}
    prepare(argv=["x"], environ=env, execve=FakeExec(), malloc=TC, torch_loaded=True, say=lambda s: None)
    assert runtime_info(env)["startup_step"] == "not run"
    prepare(argv=["x"], environ=env, execve=FakeExec(), malloc=None, torch_loaded=False,
            maps=Path("/nonexistent"), say=lambda s: None)
    assert runtime_info(env)["startup_step"] == "on"
