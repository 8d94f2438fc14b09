"""The job's config: its schema (runner/schema.py: the engine's dataclasses plus the runner's) registered in
Hydra's ConfigStore, the composed config made typed, and the checks types cannot make.

`conf/config.yaml` starts its defaults list with `ladle_schema` (`JobConfig`), so every group
file and command-line override is merged onto a typed node: a wrong key or a wrong type fails at
compose time naming the key (`chunking.sise=3` -> "Key 'sise' not in 'ChunkingConfig'").
Checks that need more than a type (allowed values, required paths) live in `check()`, which runs
before any data is read or any model is loaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

from ladle.engine.config import EngineConfig
from ladle.runner.schema import (
    ARRIVAL_PROCESSES,
    CLOCKS,
    COLUMN_KINDS,
    PROMPT_FORMATS,
    SOURCE_KINDS,
    ArrivalConfig,
    ExecutorConfig,
    JobConfig,
    OutputConfig,
    SamplingConfig,
    StructuredConfig,
    SyntheticConfig,
    SyntheticGroup,
    WorkloadConfig,
)

# the schema's names, importable from here as well (runner/schema.py holds them)
__all__ = [
    "ARRIVAL_PROCESSES", "CLOCKS", "COLUMN_KINDS", "CONF_DIR", "DATA_DIR", "PROMPT_FORMATS", "SOURCE_KINDS",
    "ArrivalConfig", "ConfigError", "ExecutorConfig", "JobConfig", "OutputConfig", "SamplingConfig",
    "StructuredConfig", "SyntheticConfig", "SyntheticGroup", "WorkloadConfig", "check", "engine_config",
    "register_configs", "to_job_config", "uses_load",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

class ConfigError(ValueError):
    """A config value a user set (or forgot) that cannot work; the message names the key and the fix."""


def _data_path(name: str) -> str:
    """`${ladle_data:prompts.parquet}`: a file shipped in runner/data (works installed or from the repo)."""
    return str(DATA_DIR / name)


def register_configs() -> None:
    """Register the schema and resolvers (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="ladle_schema", node=JobConfig)
    if not OmegaConf.has_resolver("ladle_data"):
        OmegaConf.register_new_resolver("ladle_data", _data_path)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """The composed DictConfig as typed dataclasses (resolves interpolations)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        key = e.full_key or "?"
        raise ConfigError(f"{key} is required and not set: add {key}=<value> to the command line") from None
    unknown = _unknown_keys(cfg)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)} (added with '+'?); see docs/RUNNER.md")
    if not isinstance(obj, JobConfig):  # composed without the schema (should not happen)
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), cfg))
    assert isinstance(obj, JobConfig)
    return obj


def _unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys a `+key=value` override added to a typed node (the schema would otherwise ignore them)."""
    out = []
    if isinstance(node, DictConfig):
        typ = OmegaConf.get_type(node)
        names = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
        for key in node:
            if key == "hydra" and not prefix:
                continue
            full = f"{prefix}{key}"
            if names is not None and key not in names:
                out.append(full)
            elif names is not None:
                out += _unknown_keys(node._get_node(key), full + ".")
    elif isinstance(node, ListConfig) and not node._is_none():
        for i, item in enumerate(node._iter_ex(resolve=False)):
            out += _unknown_keys(item, f"{prefix[:-1]}[{i}].")
    return out


def engine_config(job: JobConfig) -> EngineConfig:
    return EngineConfig(model=job.model, cache=job.cache, chunking=job.chunking,
                        max_num_seqs=job.max_num_seqs, seed=job.seed, deterministic=job.deterministic)


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is invalid: use one of {', '.join(allowed)}")


def _check_arrivals(key: str, a: ArrivalConfig) -> None:
    if a.process in ("poisson", "gamma") and a.load is None and not a.rate > 0:
        raise ConfigError(f"{key}.rate={a.rate} must be > 0 (requests per second)")
    if a.process == "gamma" and not a.burstiness > 0:
        raise ConfigError(f"{key}.burstiness={a.burstiness} must be > 0")
    if a.load is not None:
        if a.process not in ("poisson", "gamma"):
            raise ConfigError(f"{key}.load={a.load} needs {key}.process=poisson or gamma (it sets their rate)")
        if not 0 < a.load:
            raise ConfigError(f"{key}.load={a.load} must be > 0 (the fraction of engine time prefills fill, "
                              "e.g. 0.7)")


def uses_load(w: WorkloadConfig) -> bool:
    """Whether any arrival process of the workload takes its rate from a calibration."""
    procs = [w.arrivals, *w.class_arrivals.values()]
    if w.kind == "synthetic":
        procs += [g.arrival for g in w.synthetic.groups if g.arrival is not None]
    return any(a.load is not None for a in procs)


def _check_column_names(w: WorkloadConfig) -> None:
    """No key names a column by an empty string (`key=` on the command line, or an unset shell variable
    in `key=$VAR`): no column has that name, and an empty optional name must not pass as "none"."""
    if w.kind not in COLUMN_KINDS:
        return
    if not w.prompt_column:
        raise ConfigError("workload.prompt_column is empty: name the column holding the prompts "
                          "(e.g. workload.prompt_column=question; the default is 'prompt')")
    if w.arrivals.process == "trace" and not w.arrivals.column:
        raise ConfigError("workload.arrivals.column is empty: name the column holding each row's arrival time "
                          "(arrivals.process=trace; the default is 'arrival')")
    optional = {"id_column": w.id_column, "class_column": w.class_column, "max_tokens_column": w.max_tokens_column}
    for key, col in optional.items():
        if col == "":
            raise ConfigError(f"workload.{key} is empty: name a column, or leave it unset (null; "
                              f"workload.{key}=null on the command line)")


def check(job: JobConfig) -> None:
    """Every runner value that types alone do not catch, plus the engine's own validate()."""
    w = job.workload
    _one_of("workload.kind", w.kind, SOURCE_KINDS)
    _one_of("workload.prompt_format", w.prompt_format, PROMPT_FORMATS)
    _one_of("workload.arrivals.process", w.arrivals.process, ARRIVAL_PROCESSES)
    _one_of("workload.arrivals.unit", w.arrivals.unit, ("s", "ms"))
    _one_of("clock", job.clock, CLOCKS)
    if w.kind == "openai_batch" and job.executor.kind != "local":
        raise ConfigError("workload=openai_batch runs with executor=local only (its output file is written "
                          "from one run directory)")
    if w.kind == "openai_batch" and w.arrivals.process == "trace":  # its lines have no arrival column
        raise ConfigError("workload.arrivals.process=trace needs an arrival column, which workload=openai_batch "
                          "lines do not have: use offline, poisson or gamma")
    if w.kind != "synthetic" and not w.path:
        raise ConfigError(f"workload.path is not set for workload.kind={w.kind}: add workload.path=<file or directory>")
    _check_arrivals("workload.arrivals", w.arrivals)
    _check_column_names(w)
    if w.class_arrivals and not w.class_column:
        raise ConfigError("workload.class_arrivals needs workload.class_column (the column naming each row's class)")
    for name, a in w.class_arrivals.items():
        _one_of(f"workload.class_arrivals.{name}.process", a.process, ("offline", "poisson", "gamma"))
        _check_arrivals(f"workload.class_arrivals.{name}", a)
    if w.limit is not None and w.limit < 0:
        raise ConfigError(f"workload.limit={w.limit} must be >= 0 or null")
    if w.batch_size < 1:
        raise ConfigError(f"workload.batch_size={w.batch_size} must be >= 1")
    if w.kind == "synthetic":
        if not w.synthetic.groups:
            raise ConfigError("workload.synthetic.groups is empty: give at least one group")
        for i, g in enumerate(w.synthetic.groups):
            key = f"workload.synthetic.groups[{i}]"
            if g.num_requests < 0 or g.prompt_len < 1 or g.min_prompt_len < 1:
                raise ConfigError(f"{key}: num_requests must be >= 0, prompt_len and min_prompt_len >= 1")
            if g.shared_prefix_len < 0 or g.prompt_len_sigma < 0 or g.max_tokens_sigma < 0:
                raise ConfigError(f"{key}: shared_prefix_len and the sigmas must be >= 0")
            if g.arrival is not None:
                _one_of(f"{key}.arrival.process", g.arrival.process, ("offline", "poisson", "gamma"))
                _check_arrivals(f"{key}.arrival", g.arrival)
    if job.output.row_group_size < 1 or job.output.steps_row_group_size < 1:
        raise ConfigError("output.row_group_size and output.steps_row_group_size must be >= 1")
    if job.threads is not None and job.threads < 1:
        raise ConfigError(f"threads={job.threads} must be >= 1 or null (null = the free cores)")
    if job.max_pending is not None and job.max_pending < job.max_num_seqs:
        raise ConfigError(f"max_pending={job.max_pending} must be >= max_num_seqs ({job.max_num_seqs}) or null")
    _check_sampling(job)
    try:
        engine_config(job).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_sampling(job: JobConfig) -> None:
    from ladle.runner.sampling import COLUMN_KEYS, base_params, param_problems
    from ladle.runner.vocabulary import stop_token_ids_error

    w = job.workload
    for key, column in w.columns.items():
        if key not in COLUMN_KEYS:
            raise ConfigError(f"workload.columns.{key}: {key!r} is not a per-row sampling key; "
                              f"use one of {', '.join(COLUMN_KEYS)}")
        if not isinstance(column, str) or not column:
            raise ConfigError(f"workload.columns.{key}={column!r} must name a column")
    if (w.columns or w.max_tokens_column) and w.kind in ("synthetic", "openai_batch"):
        raise ConfigError(f"workload.columns / max_tokens_column name dataset columns; workload.kind={w.kind} has "
                          "none (synthetic: the groups' max_tokens; openai_batch: each line's body)")
    mt = w.columns.get("max_tokens")
    if mt and w.max_tokens_column and mt != w.max_tokens_column:
        raise ConfigError(f"workload.max_tokens_column={w.max_tokens_column!r} and workload.columns.max_tokens="
                          f"{mt!r} disagree: set one of them")
    try:
        params = base_params(job.sampling)
    except ValueError as e:
        raise ConfigError(f"sampling{'' if str(e).startswith('logit_bias') else '.structured'}: {e}") from None
    problems = param_problems(params)
    if problems:
        raise ConfigError("sampling: " + "; ".join(problems))
    error = (stop_token_ids_error(job.sampling.stop_token_ids, job.model)
             or stop_token_ids_error(list(params.logit_bias or {}), job.model, "sampling.logit_bias"))
    if error:
        raise ConfigError(error)
    if params.structured is not None:  # a spec for every row that cannot compile would fail every row
        from ladle.engine.structured_output import spec_error

        error = spec_error(params.structured)
        if error:
            raise ConfigError(f"sampling.structured: {error}")
