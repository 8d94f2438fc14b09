"""Resume: what earlier runs into a run directory already wrote, so this run skips it.

Before a run writes, its directory is made consistent (`prepare_run_dir`): a finished-but-unrenamed
`.tmp` replaces its file and a cut-off one is dropped. Without `output.resume` the previous files stay
until this run's replace them (runner/writer.py): a run that fails before writing loses nothing.
`ResumeState.read` then reads generations.parquet back: per id, the samples already written, as a bit
mask (bit k: sample k; one int per id, as compact as the set of ids it replaces), and the (id, index)
of a repeated id's error rows. The request reader skips what is done and the samples already written.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc
from omegaconf import OmegaConf

from ladle.runner.config import CONF_DIR, ConfigError, OutputConfig
from ladle.runner.durable import recover
from ladle.runner.sinks import (
    GENERATIONS,
    STEPS,
    previous_attempts,
    previous_batches,
    read_config_yaml,
    sample_indices,
    tmp_path,
)
from ladle.runner.sources.rows import is_duplicate_id_error

log = logging.getLogger("ladle")

# An id whose only row is an error at sample 0 with no token failed before its prompt forked into
# samples: that row stands for all n, so the id is done whatever the row's n. (The loop writes such a row
# only once it knows: a tokenless sample-0 error of a request that ran waits until a sibling's output or
# the engine's end tells whether it was the whole request's; runner/loop.py.)
ERRORED = -1


def is_done(written: int | None, n: int) -> bool:
    """Whether an id whose previous runs wrote these samples (bit mask, or ERRORED) needs no more."""
    if written is None or written == ERRORED:
        return written is not None
    if n > written.bit_length():  # a sample index this high was never written (and no huge mask is built)
        return False
    full = (1 << n) - 1
    return written & full == full


def written_samples(written: int | None) -> frozenset[int]:
    if not written or written == ERRORED:
        return frozenset()
    return frozenset(k for k in range(written.bit_length()) if written >> k & 1)


@dataclass(frozen=True, slots=True)
class Progress:
    """What the previous runs wrote of one input row."""

    done: bool  # the row needs nothing more: it is skipped
    written: frozenset[int] = frozenset()  # its samples already written: a rerun writes only the others


@dataclass(slots=True)
class ResumeState:
    """What the previous runs into the directory wrote (empty for a fresh run)."""

    done: dict[str, int] = field(default_factory=dict)  # id -> samples written (bit mask), or ERRORED
    # (id, index) of the error rows of rows that do not own their id: a repeated id's, or one without an id
    repeats: set[tuple[str | None, int]] = field(default_factory=set)
    # Indices of rows whose id is their own index: runs before null ids became id-less error rows wrote a
    # null-id row so. An id-less row at such an index is done (not written again beside the old row).
    indices: set[int] = field(default_factory=set)
    attempt: int = 0  # this run's number: 0 for the first run into the directory

    def progress(self, rid: str | None, index: int, n: int, repeat: bool) -> Progress:
        """THE notion of done, for a row with id `rid` at `index` asking for `n` samples. A row that does not
        own its id (`repeat`: its id repeats an earlier row's; or it has none) is done when its error row
        was written; any other row when all n samples of its id were (a sample's error row counts), or
        when the id's one row is the whole request's error, before the fork."""
        if rid is None:
            return Progress((rid, index) in self.repeats or index in self.indices)
        if repeat:
            return Progress((rid, index) in self.repeats)
        written = self.done.get(rid)
        return Progress(is_done(written, n), written_samples(written))

    @classmethod
    def read(cls, gen_path: Path, steps_path: Path, output: OutputConfig) -> ResumeState:
        """An error row's sample counts as written; an id whose only row is an error at sample 0 with no
        token is ERRORED. Any other error row is that sample's alone."""
        if not output.resume:  # starting over: this run's files will hold its rows alone
            return cls()
        state = cls(attempt=max(previous_attempts(gen_path), previous_attempts(steps_path)))
        failed_early: set[str] = set()  # ids with an error row at sample 0 that drew no token
        for t in previous_batches(gen_path, True, output.retry_errors):
            errs = pc.fill_null(pc.equal(t.column("finish_reason"), "error"), False).to_pylist()
            messages = t.column("error").to_pylist()
            indices = t.column("index").to_pylist() if "index" in t.schema.names else [None] * t.num_rows
            # A pre-fork failure drew no token; a sample failing after the fork had drawn its first.
            drew = (pc.fill_null(t.column("output_tokens"), 0).to_pylist() if "output_tokens" in t.schema.names
                    else [0] * t.num_rows)
            ids = t.column("id").to_pylist()
            # only rows the old rule wrote (their index as their id): another row at the index is not this one
            state.indices.update(i for rid, i in zip(ids, indices, strict=True) if i is not None and rid == str(i))
            for rid, k, err, msg, i, n_out in zip(ids, sample_indices(t), errs, messages, indices, drew, strict=True):
                if rid is None or (err and is_duplicate_id_error(msg)):  # not the id's own row
                    state.repeats.add((rid, i))
                else:
                    state.done[rid] = state.done.get(rid, 0) | (1 << k)
                    if err and k == 0 and n_out == 0:
                        failed_early.add(rid)
        for rid in failed_early:
            if state.done[rid] == 1:
                state.done[rid] = ERRORED
        return state


def prepare_run_dir(out: Path, output: OutputConfig, config_yaml: str) -> ResumeState:
    """Make the run directory's files the latest complete ones and read what they hold (nothing when not
    resuming: the files are left as they are until this run's replace them)."""
    gen_path, steps_path = out / GENERATIONS, out / STEPS
    for p in (gen_path, steps_path):
        recover(p)
    if output.resume and (changed := config_changes(read_config_yaml(gen_path), config_yaml)):
        log.warning("resuming into %s, whose rows were made with other settings (%s); use a new hydra.run.dir "
                    "(or output.resume=false) to start over", out, describe_changes(changed))
    state = ResumeState.read(gen_path, steps_path, output)
    if state.done:
        log.info("resuming into %s: %d requests already done, attempt %d", out, len(state.done), state.attempt)
    return state


# What may differ between the runs into one directory: how rows are written, and how many are read
# (a higher workload.limit is what resuming is for). Anything else changes what the rows hold (tokens,
# or the timings and steps: chunking, cache, threads, executor...).
RESUMABLE_CHANGES = ("output", "workload.limit", "workload.batch_size")


def config_changes(previous_yaml: str | None, config_yaml: str) -> dict[str, tuple[object, object]]:
    """key -> (previous value, this run's) for every dotted key of the resolved job config that differs,
    except RESUMABLE_CHANGES; empty when there is no previous config."""
    if not previous_yaml:
        return {}
    old, new = (_flat(OmegaConf.to_container(OmegaConf.create(y))) for y in (previous_yaml, config_yaml))
    # Only keys both configs have: one only the newer has is a setting added since (by an upgrade of ladle,
    # at its default), not one the user changed.
    return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys())
            if old[k] != new[k] and not _under(k, RESUMABLE_CHANGES)}


def _under(key: str, prefixes: Iterable[str]) -> bool:
    """Whether `key` is one of the prefixes or below one ("" is above every key)."""
    return any(not p or key == p or key.startswith(p + ".") for p in prefixes)


def describe_changes(changed: dict[str, tuple[object, object]], most: int = 4) -> str:
    parts = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:most]]
    return ", ".join(parts) + (f" and {len(changed) - most} more" if len(changed) > most else "")


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_sweep_resume(out: Path, config_yaml: str, resume: bool, overrides: list[str]) -> None:
    """A multirun numbers its job directories by position: the same hydra.sweep.dir swept again with other
    values would resume one setting's rows under another's name (its report then mislabels both). Refuse
    it before anything runs when a setting this job's command line gives (`overrides`, Hydra's task
    overrides: the swept values and the fixed ones) differs from what made the rows; any other difference
    (a path that moved with the checkout, a default that changed) is the resume's warning. A sweep resumed
    with its own command passes."""
    if not resume:
        return
    gen = out / GENERATIONS
    previous = read_config_yaml(gen) or read_config_yaml(tmp_path(gen))
    given = override_keys(overrides)
    changed = {k: v for k, v in config_changes(previous, config_yaml).items() if _under(k, given)}
    if changed:
        raise ConfigError(
            f"{out} holds the rows of a sweep run with other settings ({describe_changes(changed)}); a sweep's job "
            f"directories are numbered by position, so resuming would mix two settings' rows: sweep into a new "
            f"hydra.sweep.dir, or set output.resume=false to start these runs over")


def resume_command(out_dir: Path, overrides: list[str], config_args: Iterable[str] = (),
                   cwd: str | None = None, multirun: bool = False) -> str:
    """The exact command that resumes a run into out_dir: the same interpreter, the same config tree
    (config_args: a user's --config-dir, --config-name, hydra.searchpath), the same overrides, the same
    directory. `cwd`, where the run started, comes first (`cd DIR && ...`): relative paths in the
    overrides (workload.path, model.path) and `-m ladle` from a checkout resolve from there, so the
    command resumes wherever it is pasted. `multirun`: out_dir is a sweep's directory and overrides the
    sweep's own (values with commas), so the command resumes every job of the sweep."""
    # output.resume=false would start over again: the command resumes, so it leaves that override out
    kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))
            and o.split("=", 1)[0].lstrip("+~") != "output.resume"]
    where = f"hydra.{'sweep' if multirun else 'run'}.dir={hydra_quoted(str(out_dir.resolve()))}"
    mode = ["--multirun"] if multirun else []
    command = shlex.join([sys.executable or "python", "-m", "ladle", *mode, *config_args, *kept, where])
    return f"cd {shlex.quote(cwd)} && {command}" if cwd else command


def job_resume_command(out_dir: Path, extra: dict) -> str:
    """The resume command of a job from what the CLI recorded (an executor's `extra`): a sweep's job resumes
    its whole sweep (the jobs after it never ran), any other job its own directory."""
    config, cwd = extra.get("config_args", []), extra.get("cwd")
    if extra.get("sweep_overrides") is not None:
        return resume_command(Path(extra["sweep_dir"]), extra["sweep_overrides"], config, cwd, multirun=True)
    return resume_command(out_dir, extra.get("overrides", []), config, cwd)


def sweep_overrides(sweep_dir: Path) -> list[str] | None:
    """The command-line overrides of the sweep writing into sweep_dir, from the multirun.yaml Hydra's sweeper
    saves there (None without one: a sweeper that does not write it)."""
    try:
        overrides = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task
    except Exception:  # noqa: BLE001 - absent or unreadable: the job's own command is printed instead
        return None
    return [str(o) for o in overrides]


def config_args(config_sources: Iterable, config_name: str | None, hydra_overrides: Iterable[str],
                cwd: str | None = None) -> list[str]:
    """The arguments that chose a run's config tree, from Hydra's runtime record of it: a --config-path
    other than the shipped tree, each --config-dir (a command-line config source), a --config-name other
    than the shipped one, and hydra.searchpath. Without them a resumed run with a user's configs would not
    find them. Paths are absolute (relative ones were relative to `cwd`, where the run started), so the
    command composes the same config from any directory."""
    args, searchpath = [], []
    for source in config_sources:
        where = _source_location(source, cwd)
        if source.provider == "main" and where != f"file://{CONF_DIR}":
            args += ["--config-path", where.removeprefix("file://")]
        elif source.provider == "command-line" and source.path:
            args += ["--config-dir", where.removeprefix("file://")]
        elif source.provider == "hydra.searchpath in command-line":
            searchpath.append(where)
    if config_name and config_name != "config":
        args += ["--config-name", config_name]
    for o in hydra_overrides:
        key = o.split("=", 1)[0]
        if key.lstrip("+~") == "hydra.searchpath":
            # the entries Hydra read, absolute; an override that left none (a deletion) as it was
            args.append(f"{key}=[{','.join(map(hydra_quoted, searchpath))}]" if searchpath else o)
            break  # Hydra reads the first one
    return args


def _source_location(source, cwd: str | None) -> str:
    """A config source as `scheme://path`, a file path made absolute (against `cwd`) and resolved."""
    scheme = getattr(source, "schema", None) or "file"
    path = source.path.removeprefix(f"{scheme}://")
    if scheme == "file" and path:
        path = str((Path(cwd or ".") / path).resolve())
    return f"{scheme}://{path}"


def hydra_quoted(value: str) -> str:
    """A string as a quoted Hydra override value: `=`, `,`, brackets and spaces in a path stay literal.
    Inside Hydra's quotes a backslash escapes the quote and the backslashes right before it."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"'{escaped}'"


def override_keys(overrides: list[str]) -> list[str]:
    """The config keys (or config groups, as key prefixes) that command-line overrides set."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - Hydra parsed them already; if not, compare every key
        return [""]
    return [o.key_or_group.replace("/", ".") for o in parsed if not o.key_or_group.startswith("hydra")]
