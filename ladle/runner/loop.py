"""The loop: feed the engine from the requests by arrival time, write what comes out.

It keeps three things apart:
- read-ahead: requests are read (tokenized, given their arrival time) until `max_pending` are read but
  unfinished (waiting for their arrival + in the engine), so memory is bounded whatever the dataset's size;
- arrival: a request enters the engine once the engine's clock has passed its arrival time, with that
  time as its arrival (so queueing behind a busy engine counts in its TTFT);
- time: when the engine has nothing to do, the clock jumps to the next arrival
  (`clock.advance_to`: a virtual clock skips the gap, a wall clock sleeps).
Every finished sample becomes a generations row and every engine step a steps row (runner/records.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from ladle.runner.config import JobConfig
from ladle.runner.records import error_columns, output_columns, request_columns, step_columns
from ladle.runner.requests import Pending, Requests
from ladle.runner.resume import ResumeState
from ladle.runner.sources import Source
from ladle.runner.writer import RunWriter

log = logging.getLogger("ladle")

NO_PROGRESS_LIMIT = 10_000  # consecutive engine steps without a token: the engine is stuck


class Loop:
    def __init__(self, eng: Any, job: JobConfig, source: Source, resume: ResumeState, writer: RunWriter,
                 calibration: Any = None) -> None:
        self.eng, self.writer = eng, writer
        self.requests = Requests(job, source, eng.tokenizer, resume, calibration)
        self.include_prompt = job.output.include_prompt
        self.clock = eng.clock
        self.t0 = self.clock.now()  # reset when the loop starts
        self.max_pending = job.max_pending or 4 * job.max_num_seqs
        self.heap: list[tuple[float, int, Pending]] = []  # (absolute arrival, source order, request)
        self.order = itertools.count()
        self.in_engine: dict[str, Pending] = {}  # requests with a sample the engine may still report
        # A tokenless sample-0 error of a request that ran (id -> request, row): the whole request's (it
        # failed before its fork) or sample 0's alone; held until a sibling's output or the engine's end
        # tells, so that a run stopped meanwhile never leaves a row that resume would misread.
        self.held: dict[str, tuple[Pending, dict[str, Any]]] = {}
        self.arrived = 0  # requests added since the last step
        self.last_step: int | None = None
        self.output_tokens = 0
        total = None if source.total is None else max(0, source.total - len(resume.done))
        self.bar = _progress_bar(job.output.progress, total)
        self._postfix_at = 0.0

    def close(self) -> None:
        """Abort what is still in the engine (after an interrupt), so the engine can be used again."""
        self.bar.close()
        abort = getattr(self.eng, "abort_request", None)
        if abort is not None:
            for rid in [*self.in_engine, *self.held]:
                abort(rid)
        self.in_engine.clear()
        self.held.clear()  # never written: a resume runs the request again

    def run(self) -> None:
        eng, clock = self.eng, self.clock
        self.t0 = clock.now()  # times in the outputs are from here
        requests = iter(self.requests)
        exhausted = False
        idle_steps = 0
        while True:
            exhausted = exhausted or self._read_ahead(requests)
            self._admit(clock.now())
            if eng.has_unfinished_requests():
                idle_steps = 0 if self._step() else idle_steps + 1
                if idle_steps > NO_PROGRESS_LIMIT:
                    raise RuntimeError(f"the engine made no progress in {NO_PROGRESS_LIMIT} steps with "
                                       f"{len(self.in_engine)} unfinished requests")
                if not eng.has_unfinished_requests():
                    self._drained()
            elif self.heap:
                clock.advance_to(self.heap[0][0])
            elif exhausted:
                return

    def _read_ahead(self, requests: Iterator[Pending]) -> bool:
        """Read requests while fewer than max_pending are unfinished; True once none are left."""
        while len(self.heap) + len(self.in_engine) < self.max_pending:
            p = next(requests, None)
            if p is None:
                return True
            if p.error is not None:
                self._write(p, error_columns(p))
            else:
                heapq.heappush(self.heap, (self.t0 + p.arrival, next(self.order), p))
        return False

    def _admit(self, now: float) -> None:
        """Add every request whose arrival time has come, with that time as its arrival."""
        while self.heap and self.heap[0][0] <= now:
            t, _, p = heapq.heappop(self.heap)
            self.eng.add_request(p.token_ids, p.params, request_id=p.row.id, arrival_time=t)
            self.in_engine[p.row.id] = p
            self.arrived += 1

    def _step(self) -> bool:
        """One engine step; whether it made progress (a token, or an output)."""
        outputs = self.eng.step()
        progressed = self._record_step()
        for o in outputs:
            if o.finished:
                self._finished(o)
        return bool(outputs) or progressed

    def _record_step(self) -> bool:
        s = self.eng.last_step
        if s is None or s.step == self.last_step:
            return False
        self.last_step = s.step
        for rid in s.scheduled:
            p = self.in_engine.get(rid)
            if p is not None:
                p.ran = True
        self.writer.step(step_columns(s, self.t0, self.arrived))
        self.arrived = 0
        return s.decode_tokens + s.prefill_tokens > 0

    def _finished(self, o: Any) -> None:
        """n finished outputs per request, one row each; a request that failed before its fork has one
        output (sample 0, no token) for all n."""
        rid, k = o.request_id, getattr(o, "sample_index", 0) or 0
        held = self.held.pop(rid, None)
        p = held[0] if held is not None else self.in_engine.get(rid)
        if p is None:  # a request someone else put into a shared engine: not this job's row
            log.warning("ignoring output of request %r, which this job did not add", o.request_id)
            return
        p.remaining -= 1
        values = output_columns(o, self.t0)
        tokenless_first_error = (o.finish_reason == "error" and not o.output_token_ids and held is None
                                 and k == 0 and p.remaining == p.params.n - 1 > 0)
        if tokenless_first_error and p.ran:  # the whole request's error, or sample 0's alone: wait and see
            self.in_engine.pop(rid, None)
            self.held[rid] = (p, values)
            return
        if tokenless_first_error:  # never scheduled, so never forked: the one output of all n samples
            p.remaining = 0
        if p.remaining > 0:
            self.in_engine[rid] = p  # (back from held: its siblings are still running)
        else:
            self.in_engine.pop(rid, None)
        self._write_sample(p, k, values)
        if held is not None:  # a sibling reported: the held error was sample 0's own
            self._write_sample(p, 0, held[1])

    def _drained(self) -> None:
        """The engine finished everything: a held error was its whole request's (no sibling came)."""
        for p, values in self.held.values():
            self._write_sample(p, 0, values)
        if self.in_engine:  # an engine reporting fewer outputs than samples: never wait for them
            log.warning("the engine finished %d requests without an output for every sample", len(self.in_engine))
        self.held.clear()
        self.in_engine.clear()

    def _write_sample(self, p: Pending, k: int, values: dict[str, Any]) -> None:
        if k in p.skip:  # a previous run wrote it (a resumed row)
            return
        self.output_tokens += values["output_tokens"]
        self._write(p, values)

    def _write(self, p: Pending, values: dict[str, Any]) -> None:
        row = {**request_columns(p, self.include_prompt), **values}
        self.writer.generation(row)
        if row["sample_index"] == 0:  # the bar counts requests (its total), not their n samples
            self.bar.update(1)
        now = time.monotonic()
        if now - self._postfix_at > 0.5 and not self.bar.disable:
            self._postfix_at = now
            elapsed = self.clock.now() - self.t0
            if elapsed > 0:
                self.bar.set_postfix_str(f"{self.output_tokens / elapsed:.1f} tok/s", refresh=False)


def _progress_bar(progress: bool, total: int | None) -> Any:
    from tqdm import tqdm

    disable = not progress or not sys.stderr.isatty()
    return tqdm(total=total, unit="req", desc="requests", disable=disable, dynamic_ncols=True, leave=False)
