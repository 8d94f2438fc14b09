"""A sweep's jobs run at once (a parallel Hydra launcher: joblib, submitit) share one arrival calibration
through calibration.json at the sweep root: one job measures, the others read it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One sweep job's share of the calibration: measuring takes a while and gives this process's own numbers.
JOB = """
import json, os, sys, time
from pathlib import Path
from ladle.runner import calibration as c

def measure(eng):
    time.sleep(1.0)
    return c.Calibration("same-engine", 512, float(os.getpid()), 8, 0.01)

c.calibrate, c.engine_key = measure, lambda eng: "same-engine"
run, sweep = Path(sys.argv[1]), Path(sys.argv[2])
cal = c.shared_calibration(None, [run / c.CALIBRATION, sweep / c.CALIBRATION])
print(json.dumps(cal.as_dict()))
"""


def test_sweep_jobs_started_together_measure_once_and_replay_the_same_arrivals(tmp_path):
    """Before, every job measured (none had stored it yet), each kept its own numbers, so the sweep's runs
    replayed different arrivals, and two jobs renaming the same calibration.tmp could crash one."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    jobs = [subprocess.Popen([sys.executable, "-c", JOB, str(sweep / str(i)), str(sweep)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    results = [j.communicate(timeout=120) for j in jobs]
    assert all(j.returncode == 0 for j in jobs), [err[-2000:] for _, err in results]
    cals = [json.loads(out) for out, _ in results]
    assert cals[0] == cals[1] == cals[2], cals
    assert json.loads((sweep / "calibration.json").read_text())["same-engine"] == cals[0]
    assert not list(sweep.glob("*.tmp"))
