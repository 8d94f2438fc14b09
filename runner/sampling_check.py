"""The config's sampling values, checked before any data is read or any model is loaded (exit 2).

Per-row values are checked per row (runner/sampling.py); the config's are checked here once, the same
way, plus what only the model can tell: a token id must be inside the model's vocabulary, whose size
comes from the model's config files (`models.resolve_architecture` reads no weights).
"""

from __future__ import annotations

from runner.config import ConfigError, JobConfig


def check_sampling(job: JobConfig) -> None:
    """`workload.columns` names sampling keys and columns; `sampling` is usable for every row."""
    from runner.sampling import COLUMN_KEYS, base_params, param_problems

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
        raise ConfigError(f"sampling.structured: {e}") from None
    problems = param_problems(params)
    if problems:
        raise ConfigError("sampling: " + "; ".join(problems))
    check_vocabulary(job)
    if params.structured is not None:  # a spec for every row that cannot compile would fail every row
        from engine.structured_output import spec_error

        error = spec_error(params.structured)
        if error:
            raise ConfigError(f"sampling.structured: {error}")


def check_vocabulary(job: JobConfig) -> None:
    """Config-wide token ids (sampling.stop_token_ids) are inside the model's vocabulary [0, vocab_size):
    the engine would otherwise meet them only when a request uses them, the grammar layer among others."""
    ids = list(job.sampling.stop_token_ids)
    if not ids:
        return  # nothing to check: no need to read the model's config files
    from models import resolve_architecture

    m = job.model
    try:
        _, arch = resolve_architecture(m.path, m.architecture, m.random_weights)
    except (FileNotFoundError, ValueError, KeyError) as e:  # what the engine's config phase reports as well
        raise ConfigError(str(e)) from None
    bad = [t for t in ids if not 0 <= t < arch.vocab_size]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ConfigError(f"sampling.stop_token_ids={ids!r:.200}: [{shown}] outside the vocabulary "
                          f"[0, {arch.vocab_size}) of model {m.name!r}; use ids of this model's tokenizer")
