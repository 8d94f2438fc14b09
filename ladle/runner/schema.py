"""The job's config schema: the runner's dataclasses (workload, sampling, output, executor) and the job that
holds them with the engine's (model, cache, chunking). runner/config.py registers `JobConfig` in Hydra's
ConfigStore, so a wrong key or type fails at compose time; the values types cannot catch are checked there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ladle.engine.config import CacheConfig, ChunkingConfig, ModelConfig

SOURCE_KINDS = ("parquet", "arrow", "hf_dataset", "jsonl", "synthetic", "openai_batch")
COLUMN_KINDS = ("parquet", "arrow", "hf_dataset", "jsonl")  # the kinds whose rows come from named columns
PROMPT_FORMATS = ("auto", "text", "chat", "tokens")
ARRIVAL_PROCESSES = ("offline", "poisson", "gamma", "trace")
CLOCKS = ("virtual", "wall")


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
    # Where generations, steps and summary are kept: null = the run directory; a URI (s3://, gs://, az://,
    # hf://) or a local directory gets a copy of each at the end of the run, and resume reads from it.
    path: str | None = None


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
