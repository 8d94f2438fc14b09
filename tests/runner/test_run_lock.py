"""One job per run directory: a second job refuses while the first lives, and recovers once it is dead."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ladle.runner.config import ConfigError
from ladle.runner.run_lock import RunDirBusy, RunDirLock
from tests.runner.test_cli import FAST, PROMPTS

ROOT = Path(__file__).resolve().parents[2]

# A job's stand-in that holds the run directory as a job does, then waits to be killed.
HOLD = """
import sys, time
from pathlib import Path
from ladle.runner.run_lock import RunDirLock
with RunDirLock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def ladle_run(out: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ladle", f"hydra.run.dir={out}", f"workload.path={PROMPTS}",
                           "workload.limit=2", *FAST], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_a_second_job_refuses_a_live_owner_and_recovers_after_its_owner_is_killed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    live_tmp = out / "generations.parquet.tmp"  # the live job's file being written (no footer yet)
    live_tmp.write_bytes(b"PAR1 rows still being written")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        second = ladle_run(out, tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"pid {owner.pid}" in second.stderr and "in use by another ladle job" in second.stderr, \
            second.stderr[-3000:]
        assert live_tmp.exists()  # the live job's file is left alone
        assert not (out / "generations.parquet").exists()
    finally:
        owner.send_signal(signal.SIGKILL)  # killed outright: the kernel releases its lock
        owner.wait(timeout=30)
    third = ladle_run(out, tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert not live_tmp.exists() and (out / "generations.parquet").exists()  # the dead owner's leftover recovered


def test_the_lock_is_released_when_the_job_ends_and_refuses_a_second_holder(tmp_path):
    with RunDirLock(tmp_path), pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"), RunDirLock(tmp_path):
        pass
    with RunDirLock(tmp_path):  # released by the first holder's end: taken again
        pass


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.ENOSPC])
@pytest.mark.parametrize("at", ["open", "write"])
def test_a_run_directory_that_cannot_take_the_lock_is_a_config_error_naming_it(tmp_path, monkeypatch, err, at):
    """A read-only directory, a lock file another user owns, a full disk: the job stops before anything
    runs with exit 2's error naming the directory and the cause (before, an OSError traceback, exit 1)."""
    real_open, real_pwrite = os.open, os.pwrite

    def fail(*a, **kw):
        raise OSError(err, os.strerror(err))

    if at == "open":
        monkeypatch.setattr(os, "open", lambda p, *a, **kw: fail() if str(p).endswith(".ladle.lock")
                            else real_open(p, *a, **kw))
    else:
        monkeypatch.setattr(os, "pwrite", fail)
    with pytest.raises(ConfigError, match=f"{tmp_path}.*{os.strerror(err)}.*hydra.run.dir"), RunDirLock(tmp_path):
        pass
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    with RunDirLock(tmp_path):  # nothing held on: the directory is taken once the cause is gone
        pass
