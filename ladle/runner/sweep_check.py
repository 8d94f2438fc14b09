"""Hydra callback: a multirun's every job config is checked before its first job runs.

Hydra composes each job's config only when that job starts, so a sweep point with an invalid value
(`chunking.size=128,0,512`) was found after the jobs before it had loaded the model and read the whole
dataset, and the jobs after it never ran. Here the sweep is expanded as Hydra's basic sweeper expands it,
each job's config composed and put through the same check a job runs first (runner/config.check: values
only, no file or model is opened); any failure stops the sweep before it starts, naming the job's
overrides. Other sweepers (which choose their points as they go) are left alone.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from ladle.runner.redact import redact

log = logging.getLogger("ladle")


class SweepCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        errors = sweep_config_errors(config)
        if errors:
            from ladle.runner.cli import CONFIG_ERROR_EXIT

            shown = "\n".join(f"  job {i} ({overrides}): {e}" for i, overrides, e in errors)
            print(redact(f"ladle: config error: {len(errors)} job(s) of this sweep would fail their config check, so "
                         f"none was run:\n{shown}"), file=sys.stderr)
            sys.exit(CONFIG_ERROR_EXIT)


def sweep_config_errors(config: DictConfig) -> list[tuple[int, str, str]]:
    """(job number, its overrides, the error) of every job of a basic-sweeper multirun whose config fails."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return []
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ladle.runner.config import ConfigError, check, to_job_config

    # As BasicSweeper.sweep: the sweeper's own params from the config, then the command line's overrides.
    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    loader = GlobalHydra.instance().config_loader()
    try:  # with the config loader, as BasicSweeper parses them: glob(...) lists a group's options through it
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    except Exception as e:  # noqa: BLE001 - the sweeper reports its own parse errors, once
        log.debug("sweep check skipped: %r", e)
        return []
    errors = []
    for i, job in enumerate(jobs):
        try:
            cfg = loader.load_sweep_config(config, list(job))
            with open_dict(cfg):  # the job's own config, as its task function gets it (no hydra node)
                cfg.pop("hydra", None)
            check(to_job_config(cfg))
        except ConfigError as e:
            errors.append((i, " ".join(job), str(e)))
        except Exception as e:  # noqa: BLE001 - anything else is the job's own to report when it runs
            log.debug("sweep check: job %d (%s) left to its run: %r", i, " ".join(job), e)
    return errors
