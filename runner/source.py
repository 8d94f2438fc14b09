"""Sources: stream a dataset's rows in batches, whatever it is stored in.

Parquet and Arrow files or directories, HF `datasets` (save_to_disk directories, or local data files
read with `load_dataset(..., streaming=True)`), JSONL, and synthetic random-token prompts. Every
source yields lists of `Row` (one record batch at a time) and never holds more than a batch or two in
memory, so a dataset larger than memory streams through.

A row's prompt is one of: text (str), chat messages (list of {role, content}; the tokenizer's chat
template is applied) or token ids (list of int). `encode_prompt` turns it into token ids, or into an
error message for the output row (null, empty, wrongly typed): one bad row never stops the job.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from runner.config import ConfigError, WorkloadConfig

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
HF_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv",
               ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


@dataclass(slots=True)
class Row:
    index: int  # position in the source, from 0
    id: str  # the id column's value, else str(index)
    prompt: Any  # str | list[dict] | list[int] | None
    max_tokens: Any = None  # the max_tokens column's raw value, or a synthetic row's draw (None: the default)
    arrival: Any = None  # the trace column's raw value
    error: str | None = None  # the row could not be read (e.g. a bad JSON line)
    klass: str | None = None  # the request class (workload.class_column; a synthetic row's group)
    sampling: dict[str, Any] | None = None  # raw per-row sampling values by key (workload.columns)


DUPLICATE_ID = "duplicate id "  # how a repeated id's error row starts (resume tells them apart by it)


def duplicate_id_error(rid: str, column: str | None) -> str:
    return f"{DUPLICATE_ID}{rid!r} in column {column!r}"


def is_duplicate_id_error(error: str | None) -> bool:
    return bool(error) and error.startswith(DUPLICATE_ID)


class Source:
    """Base: `batches()` yields lists of rows in source order; `total` is the row count when cheap to know."""

    total: int | None = None
    description: str = ""

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        self.cfg = cfg
        self.arrival_column = arrival_column
        self.vocab_size: int | None = None  # set by the job before iterating (synthetic needs it)
        self.keep: Callable[[int], bool] | None = None  # executor=ray: skip (unparsed) rows of other replicas

    @property
    def sampling_columns(self) -> dict[str, str]:
        """Sampling key -> column (workload.columns, with workload.max_tokens_column as max_tokens)."""
        return sampling_columns(self.cfg)

    @property
    def value_names(self) -> dict[str, str]:
        """Sampling key -> where a row's value comes from, as error messages name it."""
        return {k: f"column {c!r}" for k, c in self.sampling_columns.items()}

    @property
    def columns(self) -> list[str]:
        c = self.cfg
        cols = [c.prompt_column, c.id_column, self.arrival_column, c.class_column, *self.sampling_columns.values()]
        return list(dict.fromkeys(x for x in cols if x))

    def batches(self) -> Iterator[list[Row]]:
        raise NotImplementedError

    def _check_columns(self, available: list[str], where: str) -> None:
        keys = {"prompt_column": self.cfg.prompt_column, "id_column": self.cfg.id_column,
                "max_tokens_column": self.cfg.max_tokens_column, "arrivals.column": self.arrival_column,
                "class_column": self.cfg.class_column,
                **{f"columns.{k}": v for k, v in self.cfg.columns.items()}}
        for key, col in keys.items():
            if col and col not in available:
                raise ConfigError(f"workload.{key}={col!r} is not a column of {where}; "
                                  f"its columns are: {', '.join(available) or '(none)'}")

    def _check_column_types(self, schema: pa.Schema, where: str) -> None:
        """A sampling column whose Arrow type can hold no usable value (a struct of temperatures, a
        boolean seed) is a config error now, not an error row for every row after the model loads."""
        for key, col in self.sampling_columns.items():
            t = schema.field(col).type
            if not _usable_type(key, t):
                raise ConfigError(f"workload column {col!r} (sampling {key}) in {where} has type {t}, which "
                                  f"cannot hold {key} values ({_TYPE_HINT[_type_group(key)]}); "
                                  "point the key at another column or convert this one")

    def _rows(self, cols: dict[str, list], start: int) -> list[Row]:
        c = self.cfg
        n = len(cols[c.prompt_column])
        ids = cols.get(c.id_column) if c.id_column else None
        arr = cols.get(self.arrival_column) if self.arrival_column else None
        cls = cols.get(c.class_column) if c.class_column else None
        sampling = {key: cols[col] for key, col in self.sampling_columns.items()}
        out = []
        for i in range(n):
            index = start + i
            rid = ids[i] if ids is not None else None
            values = {key: v[i] for key, v in sampling.items()}
            out.append(Row(index=index, id=str(index) if rid is None else str(rid), prompt=cols[c.prompt_column][i],
                           max_tokens=values.get("max_tokens"), arrival=arr[i] if arr is not None else None,
                           klass=None if cls is None or cls[i] is None else str(cls[i]), sampling=values or None))
        return out

    def _limited(self, batches: Iterator[dict[str, list]]) -> Iterator[list[Row]]:
        """Turn column batches into rows, numbering them and stopping at workload.limit."""
        limit = self.cfg.limit
        start = 0
        for cols in batches:
            rows = self._rows(cols, start)
            if limit is not None and start + len(rows) >= limit:
                rows = rows[: limit - start]
                if rows:
                    yield rows
                return
            start += len(rows)
            if rows:
                yield rows

    def _arrow_batches(self, batches: Iterator[pa.RecordBatch | pa.Table]) -> Iterator[list[Row]]:
        cols = self.columns

        def as_lists() -> Iterator[dict[str, list]]:
            for b in batches:
                yield {name: b.column(name).to_pylist() for name in cols}

        return self._limited(as_lists())


def _resolve(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"workload.path={path!r} does not exist (relative paths are from {Path.cwd()})")
    return p


def _files(p: Path, suffixes: tuple[str, ...], key: str) -> list[Path]:
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes
                   and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
    if not files:
        raise ConfigError(f"workload.path={str(p)!r} has no {'/'.join(suffixes)} files for workload.kind={key}")
    return files


def _limit_total(n: int | None, limit: int | None) -> int | None:
    if n is None:
        return limit
    return n if limit is None else min(n, limit)


class ParquetSource(Source):
    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        import pyarrow.dataset as ds

        super().__init__(cfg, arrival_column)
        p = _resolve(cfg.path)
        try:
            self.dataset = ds.dataset(str(p), format="parquet")
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(f"workload.path={cfg.path!r} is not readable as Parquet: {e}") from None
        self._check_columns(self.dataset.schema.names, repr(cfg.path))
        self._check_column_types(self.dataset.schema, repr(cfg.path))
        self.description = f"parquet {cfg.path} ({len(self.dataset.files)} files)"
        self.total = _limit_total(self.dataset.count_rows(), cfg.limit)

    def batches(self) -> Iterator[list[Row]]:
        # use_threads=False keeps the row order (ids default to the row index) and bounds read-ahead.
        scanner = self.dataset.scanner(columns=self.columns, batch_size=self.cfg.batch_size, use_threads=False)
        return self._arrow_batches(scanner.to_batches())


class ArrowSource(Source):
    """Arrow IPC files (random-access "file" format or the "stream" format HF datasets write), memory-mapped."""

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        super().__init__(cfg, arrival_column)
        self.files = _files(_resolve(cfg.path), ARROW_SUFFIXES, "arrow")
        schema = self._open(self.files[0]).schema
        self._check_columns(schema.names, repr(str(self.files[0])))
        self._check_column_types(schema, repr(str(self.files[0])))
        self.description = f"arrow {cfg.path} ({len(self.files)} files)"
        total = 0
        for f in self.files:
            total += sum(b.num_rows for b in self._iter_file(f))  # zero-copy: only headers are read
        self.total = _limit_total(total, cfg.limit)

    @staticmethod
    def _open(f: Path) -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
        source = pa.memory_map(str(f), "r")
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                return pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise ConfigError(f"{f} is not an Arrow IPC file or stream: {e}") from None

    def _iter_file(self, f: Path) -> Iterator[pa.RecordBatch]:
        reader = self._open(f)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            yield from reader

    def batches(self) -> Iterator[list[Row]]:
        bs = self.cfg.batch_size

        def sliced() -> Iterator[pa.RecordBatch]:
            for f in self.files:
                for b in self._iter_file(f):
                    b = b.select(self.columns)
                    for off in range(0, b.num_rows, bs):
                        yield b.slice(off, bs)

        return self._arrow_batches(sliced())


class HFDatasetSource(Source):
    """A `save_to_disk` directory (memory-mapped Arrow) or local data files streamed by `load_dataset`."""

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        import datasets

        super().__init__(cfg, arrival_column)
        p = _resolve(cfg.path)
        self.streaming = not (p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()))
        if not self.streaming:
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[self._pick_split(list(ds.keys()))]
            self.total = _limit_total(len(ds), cfg.limit)
            names = list(ds.column_names)
        else:
            builder = cfg.hf_builder or (HF_BUILDERS.get(p.suffix.lower()) if p.is_file() else None)
            try:
                if builder:
                    ds = datasets.load_dataset(builder, data_files=str(p), split=cfg.split or "train", streaming=True)
                else:
                    ds = datasets.load_dataset(str(p), split=cfg.split or "train", streaming=True)
            except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
                raise ConfigError(f"workload.path={cfg.path!r} could not be loaded with datasets "
                                  f"(set workload.hf_builder=json|csv|parquet|text?): {e}") from None
            names = list(ds.column_names or []) or list(next(iter(ds)).keys())
        self._check_columns(names, repr(cfg.path))
        self.dataset = ds.select_columns(self.columns)
        self.description = f"hf_dataset {cfg.path}" + (" (streaming)" if self.streaming else "")

    def _pick_split(self, splits: list[str]) -> str:
        if self.cfg.split:
            if self.cfg.split not in splits:
                raise ConfigError(f"workload.split={self.cfg.split!r} is not a split of {self.cfg.path!r}: {splits}")
            return self.cfg.split
        if "train" in splits or len(splits) != 1:
            if "train" not in splits:
                raise ConfigError(f"{self.cfg.path!r} has splits {splits}: choose one with workload.split=")
            return "train"
        return splits[0]

    def batches(self) -> Iterator[list[Row]]:
        bs = self.cfg.batch_size
        if self.streaming:
            return self._limited(iter(self.dataset.iter(batch_size=bs)))
        return self._arrow_batches(self.dataset.with_format("arrow").iter(batch_size=bs))


class JsonlSource(Source):
    """JSON Lines, one object per line, read line by line (a bad line becomes an error row)."""

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        super().__init__(cfg, arrival_column)
        self.files = _files(_resolve(cfg.path), JSONL_SUFFIXES, "jsonl")
        first = self._first_object()
        if first is not None:
            self._check_columns(list(first), f"the first line of {self.files[0]}")
        self.description = f"jsonl {cfg.path} ({len(self.files)} files)"
        self.total = _limit_total(sum(self._count(f) for f in self.files), cfg.limit)

    def _first_object(self) -> dict | None:
        for f in self.files:
            with open(f, "rb") as fh:
                for line in fh:
                    if line.strip():
                        try:
                            obj = json.loads(line)
                        except (json.JSONDecodeError, UnicodeDecodeError):
                            return None
                        return obj if isinstance(obj, dict) else None
        return None

    @staticmethod
    def _count(f: Path) -> int:
        n = 0
        with open(f, "rb") as fh:
            for line in fh:
                n += bool(line.strip())
        return n

    def batches(self) -> Iterator[list[Row]]:
        c = self.cfg
        bs = c.batch_size
        limit = c.limit
        index = 0
        batch: list[Row] = []
        for f in self.files:
            with open(f, "rb") as fh:  # bytes: a line that is not UTF-8 is that row's error, not a crash
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    if limit is not None and index >= limit:
                        break
                    if self.keep is not None and not self.keep(index):
                        index += 1
                        continue
                    try:
                        obj = json.loads(line)
                        if not isinstance(obj, dict):
                            raise TypeError(f"a JSON {type(obj).__name__}, not an object")
                    except (ValueError, TypeError) as e:
                        batch.append(Row(index=index, id=str(index), prompt=None,
                                         error=f"{f.name} line {lineno} is not a JSON object: {e}"))
                    else:
                        rid = obj.get(c.id_column) if c.id_column else None
                        values = {k: obj.get(col) for k, col in self.sampling_columns.items()}
                        batch.append(Row(index=index, id=str(index) if rid is None else str(rid),
                                         prompt=obj.get(c.prompt_column), max_tokens=values.get("max_tokens"),
                                         arrival=obj.get(self.arrival_column) if self.arrival_column else None,
                                         klass=_klass(obj.get(c.class_column) if c.class_column else None),
                                         sampling=values or None))
                    index += 1
                    if len(batch) >= bs:
                        yield batch
                        batch = []
        if batch:
            yield batch


_TYPE_HINT = {
    "number": "numbers or their text",
    "stop": "a string or a list of strings",
    "json_schema": "JSON text or a struct",
    "choice": "a list of strings or its JSON text",
    "text": "strings",
}


def _type_group(key: str) -> str:
    if key in ("stop", "json_schema", "choice"):
        return key
    return "text" if key in ("regex", "grammar") else "number"


def _usable_type(key: str, t: pa.DataType) -> bool:
    """Whether a column of Arrow type `t` can hold values for sampling `key` (runner/sampling.py parses
    them per row; this only refuses types no row of which could be used)."""
    text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
    if pa.types.is_null(t) or text or pa.types.is_dictionary(t):
        return True
    group = _type_group(key)
    if group == "number":
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    if group in ("stop", "choice"):  # a list of any layout whose items can be strings
        listed = (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                  or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
        return listed and _usable_type("regex", t.value_type)
    if group == "json_schema":  # a struct reads as a mapping (a map as a list of pairs); `true` = any
        return pa.types.is_struct(t) or pa.types.is_boolean(t)
    return False


def sampling_columns(cfg: WorkloadConfig) -> dict[str, str]:
    """Sampling key -> the column holding each row's value (workload.columns + max_tokens_column)."""
    cols = dict(cfg.columns)
    if cfg.max_tokens_column:
        cols.setdefault("max_tokens", cfg.max_tokens_column)
    return cols


def _klass(value: Any) -> str | None:
    return None if value is None else str(value)


class SyntheticSource(Source):
    """Random token-id prompts, seeded, from one or more groups (lognormal prompt and output lengths).

    Ids are "<group>-<k>". A group with its own `arrival` gives each row an arrival time (seconds; 0
    for groups without one), read by `workload.arrivals.process=trace`; rows are ordered by that time. Token ids are drawn
    per row from a generator seeded by (seed, group, k), so only arrival times are held in memory.
    """

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        super().__init__(cfg, arrival_column)
        s = cfg.synthetic
        n = sum(g.num_requests for g in s.groups)
        self.total = n if cfg.limit is None else min(n, cfg.limit)
        self.calibration = None  # set by the job when a group's arrival has a `load` (runner/calibration.py)
        self.rates: dict[str, float] = {}  # group -> the rate its `load` resolved to
        self.description = "synthetic " + ", ".join(f"{g.name} x{g.num_requests}" for g in s.groups)

    def group_prompt_lengths(self, gi: int) -> list[int]:
        """The prompt lengths of group gi's rows (the same draws as batches() makes)."""
        s, g = self.cfg.synthetic, self.cfg.synthetic.groups[gi]
        return [g.shared_prefix_len + self._lengths(np.random.default_rng([s.seed, gi, k]), g.prompt_len,
                                                    g.prompt_len_sigma, g.min_prompt_len, g.max_prompt_len)
                for k in range(g.num_requests)]

    def _plan(self) -> list[tuple[float, int, int]]:
        """(arrival, group index, k) of every row, in arrival order. Drawn when reading starts, so a
        group whose arrivals have a `load` gets its rate from the calibration the job made."""
        from runner.arrivals import arrival_times

        plan = []
        for gi, g in enumerate(self.cfg.synthetic.groups):
            if g.arrival is None:
                times = np.zeros(g.num_requests)
            else:
                rate = None
                if g.arrival.load is not None:
                    if self.calibration is None:
                        raise ConfigError(f"workload.synthetic group {g.name!r}: arrival.load needs a calibration")
                    lengths = self.group_prompt_lengths(gi)
                    rate = self.calibration.rate(g.arrival.load, sum(lengths) / max(len(lengths), 1))
                    self.rates[g.name] = rate
                times = arrival_times(g.arrival, g.num_requests, rate)
            plan += [(float(t), gi, k) for k, t in enumerate(times)]
        plan.sort()
        return plan if self.cfg.limit is None else plan[: self.cfg.limit]

    def _lengths(self, rng: np.random.Generator, median: int, sigma: float, lo: int, hi: int | None) -> int:
        n = median * float(np.exp(rng.normal(0.0, sigma))) if sigma > 0 else median
        n = max(lo, round(n))
        return min(n, hi) if hi is not None else n

    def batches(self) -> Iterator[list[Row]]:
        s = self.cfg.synthetic
        vocab = s.vocab_size or self.vocab_size
        if vocab is None or vocab <= s.min_token_id:
            raise ConfigError(f"workload.synthetic: vocabulary size {vocab} must exceed min_token_id={s.min_token_id}")
        prefixes = []
        for gi, g in enumerate(s.groups):
            rng = np.random.default_rng([s.seed, gi, 1 << 30])
            prefixes.append(rng.integers(s.min_token_id, vocab, size=g.shared_prefix_len).tolist())
        batch: list[Row] = []
        for index, (t, gi, k) in enumerate(self._plan()):
            g = s.groups[gi]
            rng = np.random.default_rng([s.seed, gi, k])
            n = self._lengths(rng, g.prompt_len, g.prompt_len_sigma, g.min_prompt_len, g.max_prompt_len)
            ids = prefixes[gi] + rng.integers(s.min_token_id, vocab, size=n).tolist()
            mt = (self._lengths(rng, g.max_tokens, g.max_tokens_sigma, 1, None) if g.max_tokens is not None else None)
            batch.append(Row(index=index, id=f"{g.name}-{k}", prompt=ids, max_tokens=mt, arrival=t, klass=g.name))
            if len(batch) >= self.cfg.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


SOURCES: dict[str, type[Source]] = {
    "parquet": ParquetSource,
    "arrow": ArrowSource,
    "hf_dataset": HFDatasetSource,
    "jsonl": JsonlSource,
    "synthetic": SyntheticSource,
}


def _openai_batch(cfg: WorkloadConfig, arrival_column: str | None) -> Source:
    from runner.openai_batch import OpenAIBatchSource

    return OpenAIBatchSource(cfg, arrival_column)


SOURCES["openai_batch"] = _openai_batch  # type: ignore[assignment]


def open_source(cfg: WorkloadConfig) -> Source:
    """Open (and check the columns of) the workload's source, before any model is loaded."""
    arrival_column = cfg.arrivals.column if cfg.arrivals.process == "trace" else None
    if cfg.kind == "synthetic":
        arrival_column = None  # synthetic rows carry their own arrival
    return SOURCES[cfg.kind](cfg, arrival_column)


# ----------------------------------------------------------------------------------------------------------
# prompts -> token ids


@dataclass(slots=True)
class Encoded:
    token_ids: list[int] | None
    text: str | None  # what the `prompt` output column shows (chat: the messages as JSON)
    error: str | None = None


def _kind_of(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) == 0:
            return "empty"
        first = value[0]
        if isinstance(first, dict):
            return "chat"
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            return "tokens"
    return None


def _messages(value: list) -> list[dict[str, str]]:
    msgs = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"message {i} is not a {{role: str, content: str}} object: {m!r:.80}")
        msgs.append({"role": m["role"], "content": m["content"]})
    return msgs


def encode_prompt(value: Any, fmt: str, tokenizer: Any, chat_template: bool, column: str,
                  chat_template_kwargs: dict[str, Any] | None = None) -> Encoded:
    """One row's prompt as token ids, or the reason it cannot be (never raises).

    chat_template_kwargs go to the template as variables (vLLM's chat_template_kwargs), e.g.
    {"enable_thinking": False} for Qwen3."""
    kw = chat_template_kwargs or {}
    if value is None:
        return Encoded(None, None, f"prompt is null (column {column!r})")
    kind = _kind_of(value)
    if kind == "empty" or (kind == "text" and not value.strip()):
        return Encoded([], value if kind == "text" else None, f"prompt is empty (column {column!r})")
    if kind is None or (fmt != "auto" and kind != fmt):
        want = "text, chat messages or token ids" if fmt == "auto" else fmt
        return Encoded(None, None, f"prompt in column {column!r} is a {type(value).__name__}, "
                                   f"expected {want} (workload.prompt_format={fmt})")
    try:
        if kind == "tokens":
            ids = [int(x) for x in value]
            if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
                raise ValueError("token ids must all be integers")
            return Encoded(ids, None)
        if kind == "chat":
            msgs = _messages(list(value))
            return Encoded(list(tokenizer.apply_chat_template(msgs, **kw)), json.dumps(msgs, ensure_ascii=False))
        if chat_template:
            return Encoded(list(tokenizer.apply_chat_template([{"role": "user", "content": value}], **kw)), value)
        return Encoded(list(tokenizer.encode(value)), value)
    except Exception as e:  # noqa: BLE001 - a tokenizer or template failure is this row's error, not the job's
        return Encoded(None, value if isinstance(value, str) else None, f"prompt could not be tokenized: {e}")
