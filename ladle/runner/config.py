"""The job's config schema: the engine's dataclasses plus the runner's, registered in Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `ladle_schema` (the `JobConfig` below), so every group
file and command-line override is merged onto a typed node: a wrong key or a wrong type fails at
compose time naming the key (`chunking.sise=3` -> "Key 'sise' not in 'ChunkingConfig'").
Checks that need more than a type (allowed values, required paths) live in `check()`, which runs
before any data is read or any model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

from ladle.engine.config import CacheConfig, ChunkingConfig, EngineConfig, ModelConfig

DATA_DIR = Path(__file__).resolve().parent / "data"
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

SOURCE_KINDS = ("parquet", "arrow", "hf_dataset", "jsonl", "synthetic", "openai_batch")
COLUMN_KINDS = ("parquet", "arrow", "hf_dataset", "jsonl")  # the kinds whose rows come from named columns
PROMPT_FORMATS = ("auto", "text", "chat", "tokens")
ARRIVAL_PROCESSES = ("offline", "poisson", "gamma", "trace")
CLOCKS = ("virtual", "wall")


class ConfigError(ValueError):
    """A config value a user set (or forgot) that cannot work; the message names the key and the fix."""


@dataclass
class ArrivalConfig:
    process: str = "offline"  # offline (all at start) | poisson | gamma | trace
    rate: float = 1.0  # poisson, gamma: mean requests per second
    # poisson, gamma: instead of `rate`, arrive so that these requests' prefill work would fill this
    # fraction of the engine's time, measured by a calibration of the model at hand (runner/calibration.py)
    load: float | None = None
    burstiness: float = 1.0  # gamma shape: 1 = poisson, < 1 burstier, > 1 more regular
    column: str = "arrival"  # trace: the column holding each request's arrival time
    unit: str = "s"  # trace: s | ms
    start: float = 0.0  # seconds added to every arrival
    seed: int = 0


@dataclass
class SyntheticGroup:
    """One population of random-token prompts (a workload may mix several, e.g. decode streams + long prompts)."""

    name: str = "prompts"
    num_requests: int = 32
    prompt_len: int = 128  # median length in tokens of each prompt's own part (lognormal)
    prompt_len_sigma: float = 0.0  # sigma of log(length); 0 = every prompt is prompt_len long
    min_prompt_len: int = 1
    max_prompt_len: int | None = None
    shared_prefix_len: int = 0  # tokens of a preamble shared by the whole group, put before each prompt
    max_tokens: int | None = None  # median output length; null = sampling.max_tokens
    max_tokens_sigma: float = 0.0  # sigma of log(max_tokens)
    arrival: ArrivalConfig | None = None  # this group's own arrivals (read with arrivals.process=trace)


@dataclass
class SyntheticConfig:
    groups: list[SyntheticGroup] = field(default_factory=lambda: [SyntheticGroup()])
    seed: int = 0
    min_token_id: int = 0  # random ids are drawn from [min_token_id, vocab size)
    vocab_size: int | None = None  # null = the engine's tokenizer vocabulary


@dataclass
class WorkloadConfig:
    name: str = "sample"
    kind: str = "parquet"  # parquet | arrow | hf_dataset | jsonl | synthetic
    path: str | None = None  # file or directory (parquet, arrow); save_to_disk dir or data files (hf_dataset)
    split: str | None = None  # hf_dataset: split of a DatasetDict (null = train, or the only split)
    hf_builder: str | None = None  # hf_dataset data files: json | csv | parquet | text ... (null = from extension)
    prompt_column: str = "prompt"
    prompt_format: str = "auto"  # auto (by value: str | list of {role, content} | list of ints) | text | chat | tokens
    chat_template: bool = False  # wrap text prompts as one user message and apply the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables, e.g. enable_thinking
    id_column: str | None = None  # null = the row index
    class_column: str | None = None  # a column naming each row's request class (plots, per-class arrivals)
    class_arrivals: dict[str, ArrivalConfig] = field(default_factory=dict)  # class value -> its own arrivals
    max_tokens_column: str | None = None  # per-row max_tokens (null values fall back to sampling.max_tokens)
    # per-row sampling: sampling key -> the column holding it, e.g. {temperature: temp, json_schema: schema};
    # a row's null falls back to the `sampling` default (keys: ladle.runner.sampling.COLUMN_KEYS)
    columns: dict[str, str] = field(default_factory=dict)
    limit: int | None = None  # read at most this many rows
    batch_size: int = 256  # rows per record batch read from the source
    ignore_eos: bool | None = None  # null = sampling.ignore_eos (synthetic benchmarks set true)
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class StructuredConfig:
    """Constrained decoding for every row (at most one set; a row's own column replaces it)."""

    json_schema: Any = None  # a JSON schema: a mapping, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF / GBNF text


@dataclass
class SamplingConfig:
    """ladle.engine.SamplingParams as a config node (its structured field is a typed sub-node here, since a
    config type cannot be "text or mapping"); ladle.runner.sampling.base_params turns it into SamplingParams."""

    max_tokens: int | None = 16  # null = up to cache.max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # set: row i samples with seed + i (a seed column gives the row's own)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # samples per prompt: one generations row each (sample_index)
    logprobs: int | None = None  # null = off; k: the chosen token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # null = off; k: every prompt token's logprob (+ top-k)
    min_tokens: int = 0  # EOS / stop_token_ids / stop strings end nothing before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = None  # {token id: bias}
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredConfig = field(default_factory=StructuredConfig)


@dataclass
class OutputConfig:
    include_prompt: bool = True  # write the prompt text (chat: messages as JSON) in generations.parquet
    row_group_size: int = 256  # generations rows per Parquet row group (each one is flushed when full)
    steps_row_group_size: int = 4096  # steps rows per row group
    plots: bool = True
    progress: bool = True  # tqdm bar (also off when stderr is not a terminal)
    print_summary: bool = True
    resume: bool = True  # skip requests already in generations.parquet of the run directory
    retry_errors: bool = False  # on resume, run rows that errored before again


@dataclass
class ExecutorConfig:
    kind: str = "local"  # local (one engine here) | ray (data-parallel replicas, runner/executors/ray.py)
    num_replicas: int = 1
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    batch_size: int = 256  # rows routed to a replica together (block b -> replica b % num_replicas)
    address: str | None = None  # null = start a local Ray cluster; auto | host:port | ray://host:port joins one
    max_restarts: int = 3  # times a replica's dead actor is restarted (its task retried) before the job fails


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    max_num_seqs: int = 64  # most requests running at once
    max_pending: int | None = None  # most requests read but unfinished (null = 4 x max_num_seqs)
    seed: int = 0  # engine sampling seed (requests without their own)
    deterministic: bool = False  # batch-invariant engine: tokens/logprobs independent of the schedule (CPU fp32)
    clock: str = "virtual"  # virtual (replay: idle gaps are skipped, latencies are compute time) | wall
    threads: int | None = None  # torch CPU threads; null = the free cores (runner/threads.py)


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
