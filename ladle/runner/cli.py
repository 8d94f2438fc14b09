"""The CLI proper (`ladle` / `python -m ladle`, entered through runner/__main__.py after the start-up
step): run a job from the Hydra config tree in conf/ (see docs/RUNNER.md).

    ladle                                                     # tiny model, the shipped sample prompts
    ladle model=qwen3_4b chunking.size=256
    ladle --multirun chunking.size=128,512,1024               # + sweep report at the sweep root
    ladle workload=parquet workload.path=questions.parquet workload.prompt_column=question

The config tree ships inside the package (ladle/conf/); its path is found relative to this package, so
it works from any directory, from an editable install and from a wheel. `--config-dir DIR` adds a
user's own configs beside it.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ladle.runner.config import CONF_DIR, ConfigError, register_configs
from ladle.runner.redact import install_log_redaction, redact, redact_files

log = logging.getLogger("ladle")

register_configs()

if not (CONF_DIR / "config.yaml").exists():  # pragma: no cover - a broken install
    sys.exit(f"ladle: the config tree is missing (looked for {CONF_DIR / 'config.yaml'}); "
             "install ladle from its repository with `pip install -e .`")


CONFIG_ERROR_EXIT = 2  # a config (or data path) the user must fix; 130 = interrupted; 1 = a crash
OUTPUT_ERROR_EXIT = 1  # an output file could not be written (the previous one kept)
_task_started = False  # Hydra exits 1 on its own config errors: before any task ran, that means config
_sweep_dir: Path | None = None  # a multirun's root, once one of its jobs started
_sweep_runs = 0  # the multirun's jobs that wrote their summary.json in this process


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # finalise the outputs as Ctrl-C does


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the frames a failed job's exception went through (and of its causes).
    A multirun's Hydra keeps each failed job's exception until the whole sweep has run, and its traceback's
    frames hold the job's engine: its weights and KV cache (on a GPU, most of its memory) would stay taken
    through every later job. The traceback itself (files, lines) is kept for the report."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # frames still running (this one) are skipped
        pending += [e.__cause__, e.__context__, *(e.exceptions if isinstance(e, BaseExceptionGroup) else ())]


def _check_sweep_resume(out_dir: Path, cfg: DictConfig, overrides: list[str]) -> None:
    """Refuse a sweep job whose directory holds another setting's rows (runner/resume.check_sweep_resume)."""
    from ladle.runner.resume import check_sweep_resume

    try:
        config_yaml, resume = redact(OmegaConf.to_yaml(cfg, resolve=True)), bool(cfg.output.resume)
    except Exception:  # noqa: BLE001 - a config that does not resolve: run_job reports it as what it is
        return
    check_sweep_resume(out_dir, config_yaml, resume, overrides)


def _written_since(path: Path, started: float) -> bool:
    """Whether this job wrote `path` (a run directory reused from an earlier sweep holds an older one)."""
    try:
        return path.stat().st_mtime >= started - 1.0  # the file system's timestamps may be coarser than ours
    except OSError:
        return False


def _job_output_path(cfg: DictConfig, out_dir: Path, sweep_dir: Path) -> None:
    """A sweep's jobs keep their outputs apart under output.path, as under the sweep directory
    (`<output.path>/<job subdir>`): one output.path for all would leave only the last job's files."""
    if cfg.output.path:
        sub = out_dir.resolve().relative_to(sweep_dir.resolve()).as_posix()
        cfg.output.path = f"{str(cfg.output.path).rstrip('/')}/{sub}"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> None:
    global _task_started, _sweep_dir, _sweep_runs
    _task_started = True
    from ladle.runner.job import run_job
    from ladle.runner.resume import config_args, sweep_overrides
    from ladle.runner.sinks import OutputError

    started = time.time()
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    if hc.output_subdir:  # Hydra saved the command line as given: credentials in it are masked
        redact_files(out_dir / hc.output_subdir)
    if hc.mode == RunMode.MULTIRUN:
        # relative to where the sweep started: with hydra.job.chdir=true this job runs inside its own directory
        _sweep_dir = Path(hc.runtime.cwd, hc.sweep.dir).resolve()
        redact_files(_sweep_dir)  # Hydra's multirun.yaml holds the sweep's command line
        _job_output_path(cfg, out_dir, _sweep_dir)
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        shared = None  # a sweep's runs replay the same arrivals: one calibration at the sweep root
        if hc.mode == RunMode.MULTIRUN:
            shared = _sweep_dir / "calibration.json"
            _check_sweep_resume(out_dir, cfg, list(hc.overrides.task))
        sources = config_args(hc.runtime.config_sources, hc.job.config_name, hc.overrides.hydra, hc.runtime.cwd)
        extra = {"overrides": list(hc.overrides.task), "config_args": sources, "cwd": hc.runtime.cwd}
        if hc.mode == RunMode.MULTIRUN:  # an interrupted job's resume command resumes the whole sweep
            extra |= {"sweep_dir": str(_sweep_dir), "sweep_overrides": sweep_overrides(_sweep_dir)}
        result = run_job(cfg, out_dir, extra=extra, calibration_path=shared)
    except ConfigError as e:
        print(f"ladle: config error: {redact(str(e))}", file=sys.stderr)  # once, on stderr
        sys.exit(CONFIG_ERROR_EXIT)
    except OutputError as e:
        print(f"ladle: error: {redact(str(e))}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            release_frames(e)
        sys.exit(OUTPUT_ERROR_EXIT)
    except Exception as e:
        if hc.mode == RunMode.MULTIRUN:  # a single run's process ends here: keep the locals for a debugger
            release_frames(e)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if hc.mode == RunMode.MULTIRUN and _written_since(out_dir / "summary.json", started):
            _sweep_runs += 1
    if result.interrupted:
        sys.exit(130)


def _report_failed_sweep() -> None:
    """A multirun that ended with a failed or interrupted job: Hydra then skips its end-of-sweep callbacks, so
    the sweep report (runner/sweep.py, of every run with a summary in the sweep directory, as the callback's) is
    written here, if a job of this sweep wrote its summary (a directory reused from an earlier sweep holds
    others'). Jobs run by another process (a remote Hydra launcher) count none here: no report then."""
    if _sweep_dir is None or _sweep_runs == 0:
        return
    from ladle.runner.sweep import write_sweep_report

    try:
        files = write_sweep_report(_sweep_dir)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the job's own error and exit status stand
        print(f"ladle: the sweep ended with a failed or interrupted job, and its report failed too: {e!r}",
              file=sys.stderr)
        return
    if files:
        print(f"ladle: the sweep ended with a failed or interrupted job; the report of its runs with a summary is "
              f"in {_sweep_dir.resolve()}: " + ", ".join(p.name for p in files.values()), file=sys.stderr)


def main() -> None:
    from ladle.runner.cli_warnings import install

    global _task_started, _sweep_dir, _sweep_runs
    _task_started, _sweep_dir, _sweep_runs = False, None, 0  # main() may run twice in one process (tests)
    install()  # ladle's warnings on one line each (`ladle: warning: ...`)
    install_log_redaction()  # before Hydra logs anything (a sweep's overrides are logged first)
    try:
        _main()
    except SystemExit as e:
        # Hydra prints its own composition errors (unknown key or group option, bad override syntax)
        # once and exits 1; those are config errors too, so they exit like ladle's own.
        if e.code == 1 and not _task_started:
            sys.exit(CONFIG_ERROR_EXIT)
        if e.code not in (0, None):
            _report_failed_sweep()
        raise
    except BaseException:  # HYDRA_FULL_ERROR=1 re-raises the job's own exception; Ctrl-C between jobs
        _report_failed_sweep()
        raise
