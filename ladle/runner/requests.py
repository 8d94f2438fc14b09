"""The source's rows as requests: token ids, sampling params, an arrival time, or the row's error.

Rows are read a batch at a time. A row becomes an error request (written at once, never run) when it
cannot be read, its prompt cannot be encoded, its sampling values or arrival time are bad, its id is
null (an id column's: the source made the row's error), or its id repeats an earlier row's (then it is
an error row of its own, told apart on resume by its message).
Rows a previous run finished are skipped (`ResumeState`), but still draw their arrival time, so the
other rows arrive when they would have in an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ladle.engine.sampling_params import SamplingParams
from ladle.runner.arrivals import ArrivalError, ArrivalStreams
from ladle.runner.config import JobConfig
from ladle.runner.prompts import Encoded, encode_prompt
from ladle.runner.resume import ResumeState
from ladle.runner.sampling import base_params, row_params
from ladle.runner.sources import Row, Source
from ladle.runner.sources.base import row_failure
from ladle.runner.sources.rows import duplicate_id_error, is_duplicate_id_error


@dataclass(slots=True)
class Pending:
    """A request read but not finished: waiting for its arrival, or in the engine."""

    row: Row
    arrival: float  # seconds from the job's start (NaN: the row's arrival time was bad)
    token_ids: list[int] | None
    text: str | None
    params: SamplingParams | None
    error: str | None = None
    skip: frozenset[int] = frozenset()  # sample indices a previous run already wrote (resume)
    remaining: int = 1  # samples not yet finished
    ran: bool = False  # an engine step scheduled it (else it cannot have forked into samples)


class Requests:
    """Iterates the source's rows as `Pending` requests, in source order."""

    def __init__(self, job: JobConfig, source: Source, tokenizer: Any, resume: ResumeState,
                 calibration: Any) -> None:
        w = job.workload
        self.workload, self.source, self.tokenizer, self.resume = w, source, tokenizer, resume
        base = source.row_base(base_params(job.sampling), job.model)
        self.base = base if w.ignore_eos is None else dataclasses.replace(base, ignore_eos=w.ignore_eos)
        self.streams = ArrivalStreams(w.arrivals, w.class_arrivals if w.class_column else {}, calibration)
        self.seen: set[str] | None = set() if w.id_column else None  # ids so far (to find repeats)
        self.value_names = source.value_names  # where a sampling value comes from, for error messages
        self.resumed = 0  # rows skipped: a previous run finished them

    def __iter__(self) -> Iterator[Pending]:
        for batch in self.source.batches():
            yield from self._batch(batch)

    def _batch(self, batch: list[Row]) -> Iterator[Pending]:
        params = {row.index: self._params(row) for row in batch}
        repeats = self._repeats(batch)
        progress = {row.index: self.resume.progress(row.id, row.index, params[row.index][0].n, row.index in repeats)
                    for row in batch}
        done = {i for i, pr in progress.items() if pr.done}
        # Encoded first: a `load` arrival rate needs the mean prompt length of its rows.
        streams = self.streams
        encoded = {row.index: self._encode(row) for row in batch if row.index not in done or streams.unresolved()}
        if streams.unresolved():
            self._resolve_rates(batch, encoded)
        for row in batch:
            error = row.error
            try:
                arrival = streams.next(row.klass, row.arrival)
            except ArrivalError as e:
                arrival, error = math.nan, error or str(e)
            except Exception as e:  # noqa: BLE001 - a value nothing foresaw (a 400-digit time): this row's error
                arrival, error = math.nan, error or row_failure("this row's arrival time", e)
            if row.index in done:
                self.resumed += 1
                continue
            repeat = row.index in repeats
            if repeat:
                error = error or duplicate_id_error(row.id, self.workload.id_column)
            enc = encoded[row.index]
            p, p_error = params[row.index]
            error = error or enc.error or p_error
            yield Pending(row, arrival, enc.token_ids, enc.text, p, error, progress[row.index].written, p.n)

    def _repeats(self, batch: list[Row]) -> set[int]:
        """Indices of the batch's rows whose id repeats an earlier row's (here, or marked by a shard)."""
        repeats = {row.index for row in batch if is_duplicate_id_error(row.error)}
        if self.seen is not None:
            for row in batch:
                if row.id is None:  # no id of its own: nothing to repeat
                    continue
                if row.id in self.seen:
                    repeats.add(row.index)
                self.seen.add(row.id)
        return repeats

    # The per-row work never raises: whatever a row holds, an exception is that row's error and the
    # rows beside it run (the functions below already turn every failure they know into a message).
    def _encode(self, row: Row) -> Encoded:
        w = self.workload
        try:
            return encode_prompt(row.prompt, w.prompt_format, self.tokenizer, w.chat_template, w.prompt_column,
                                 w.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001
            return Encoded(None, None, row_failure(f"the prompt (column {w.prompt_column!r})", e))

    def _params(self, row: Row) -> tuple[SamplingParams, str | None]:
        values = dict(row.sampling or {})
        if row.max_tokens is not None:
            values.setdefault("max_tokens", row.max_tokens)
        try:
            return row_params(self.base, values, self.value_names, row.index)
        except Exception as e:  # noqa: BLE001
            return self.base, row_failure("this row's sampling values", e)

    def _resolve_rates(self, batch: list[Row], encoded: dict[int, Encoded]) -> None:
        lengths: dict[str | None, list[int]] = {}
        for row in batch:
            enc = encoded[row.index]
            if enc.token_ids and not enc.error:
                lengths.setdefault(self.streams.key(row.klass), []).append(len(enc.token_ids))
        self.streams.resolve(lengths)
