"""Summary statistics of a run, computed from its Parquet files (so a resumed run covers every row).

Latencies, seconds:
- TTFT = first token - arrival (queueing + prefill);
- ITL = gaps between consecutive tokens of a request, pooled over all requests;
- TPOT = (last token - first token) / (output tokens - 1), one value per request with >= 2 tokens;
- E2E = finish - arrival.
Throughput divides by the run's span: last finish - first arrival, summed over attempts (each resume
restarts the clock), so idle time before the first request does not count.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ladle.runner.redact import redact
from ladle.runner.sinks import OutputError, sample_indices
from ladle.runner.text import clean

LATENCIES = ("ttft", "itl", "tpot", "e2e", "queue")
STATS = ("mean", "p50", "p90", "p99", "max")
SUMMARY = "summary.json"


def distribution(values: np.ndarray) -> dict[str, float | int | None]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"count": 0, **{k: None for k in STATS}}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"count": int(v.size), "mean": float(v.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(v.max())}


def _floats(t: pa.Table, name: str) -> np.ndarray:
    return pc.fill_null(t.column(name).cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)


def itl_gaps(token_times: pa.ChunkedArray) -> np.ndarray:
    """Gaps between consecutive tokens within each list, vectorised over the flattened values."""
    out = []
    for chunk in token_times.chunks:
        chunk = pc.fill_null(chunk, pa.scalar([], chunk.type))
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        if values.size < 2:
            continue
        offsets = chunk.offsets.to_numpy()
        offsets = offsets - offsets[0]
        gaps = np.diff(values)
        same = np.ones(values.size - 1, dtype=bool)
        starts = offsets[1:-1]  # the first token of every list but the first: no gap into it
        starts = starts[(starts > 0) & (starts < values.size)]
        same[starts - 1] = False
        out.append(gaps[same])
    return np.concatenate(out) if out else np.zeros(0)


GEN_COLUMNS = ["id", "prompt_tokens", "output_tokens", "finish_reason", "arrival_s", "first_scheduled_s",
               "first_token_s", "finish_s", "token_times_s", "ttft_s", "tpot_s", "e2e_s", "num_preemptions",
               "num_cached_tokens", "attempt", "sample_index"]


@dataclass(slots=True)
class _Tally:
    """Running totals over generations batches (a run never has to fit in memory)."""

    requests: int = 0  # rows of the dataset: sample 0's rows
    samples: int = 0  # generations rows
    errors: int = 0
    completed: int = 0  # requests whose sample 0 did not error
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached: int = 0
    preemptions: int = 0
    preempted_requests: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    spans: dict[int, list[float]] = field(default_factory=dict)  # attempt -> [first arrival, last finish]
    latencies: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in LATENCIES})

    def add(self, t: pa.Table) -> None:
        # n samples of a row are n rows; the row's request (its prompt, prefilled once) is sample 0's.
        first = pa.array([k == 0 for k in sample_indices(t)], pa.bool_())
        self.samples += t.num_rows
        self.requests += pc.sum(first.cast(pa.int64())).as_py() or 0
        fr = pc.fill_null(t.column("finish_reason"), "unknown").to_pylist()
        for r in fr:
            self.reasons[r] = self.reasons.get(r, 0) + 1
        ok = pa.array([r != "error" for r in fr], pa.bool_())
        self.errors += t.num_rows - pc.sum(ok.cast(pa.int64())).as_py() if t.num_rows else 0
        good = t.filter(ok)
        good_first = t.filter(pc.and_(ok, first))
        self.completed += good_first.num_rows
        self.prompt_tokens += pc.sum(good_first.column("prompt_tokens")).as_py() or 0
        self.output_tokens += pc.sum(good.column("output_tokens")).as_py() or 0
        self.cached += pc.sum(good_first.column("num_cached_tokens")).as_py() or 0
        pre = pc.fill_null(good.column("num_preemptions"), 0)
        self.preemptions += pc.sum(pre).as_py() or 0
        self.preempted_requests += pc.sum(pc.greater(pre, 0).cast(pa.int64())).as_py() or 0
        lat = self.latencies
        lat["ttft"].append(_floats(good, "ttft_s"))
        lat["tpot"].append(_floats(good, "tpot_s"))
        lat["e2e"].append(_floats(good, "e2e_s"))
        lat["queue"].append(_floats(good, "first_scheduled_s") - _floats(good, "arrival_s"))
        lat["itl"].append(itl_gaps(good.column("token_times_s")))
        self._add_spans(t)

    def _add_spans(self, t: pa.Table) -> None:
        attempts = t.column("attempt").to_numpy(zero_copy_only=False)
        arrival, finish = _floats(t, "arrival_s"), _floats(t, "finish_s")
        for a in np.unique(attempts):
            m = attempts == a
            lo, hi = np.nanmin(arrival[m], initial=math.inf), np.nanmax(finish[m], initial=-math.inf)
            s = self.spans.setdefault(int(a), [math.inf, -math.inf])
            s[0], s[1] = min(s[0], lo), max(s[1], hi)

    def summary(self) -> dict[str, Any]:
        duration = sum(max(0.0, hi - lo) for lo, hi in self.spans.values() if hi >= lo)

        def rate(x: float) -> float | None:
            return x / duration if duration > 0 else None

        return {
            "requests": self.requests,  # rows of the dataset (with sampling.n > 1, each has n sample rows)
            "samples": self.samples,  # generations rows
            "completed": self.completed,
            "errors": self.errors,  # error rows
            "finish_reasons": dict(sorted(self.reasons.items())),
            "attempts": len(self.spans),
            "duration_s": duration,
            "throughput": {
                "requests_per_s": rate(self.completed),
                "input_tokens_per_s": rate(self.prompt_tokens),
                "output_tokens_per_s": rate(self.output_tokens),
                "total_tokens_per_s": rate(self.prompt_tokens + self.output_tokens),
            },
            "tokens": {"prompt": self.prompt_tokens, "output": self.output_tokens, "cached_prompt": self.cached},
            "prefix_cache_hit_rate": self.cached / self.prompt_tokens if self.prompt_tokens else None,
            "latency_s": {k: distribution(np.concatenate(v) if v else np.zeros(0)) for k, v in self.latencies.items()},
            "preemptions": self.preemptions,
            "preempted_requests": self.preempted_requests,
        }


def summarize(gen_path: Path, steps_path: Path | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary dict of a run directory's generations.parquet (+ steps.parquet); `extra` is merged in."""
    pf = pq.ParquetFile(gen_path)
    columns = [c for c in GEN_COLUMNS if c in pf.schema_arrow.names]  # sample_index: files from before it
    tally = _Tally()
    for batch in pf.iter_batches(batch_size=8192, columns=columns):
        tally.add(pa.Table.from_batches([batch]))
    summary = tally.summary()
    if steps_path is not None and Path(steps_path).exists():
        st = summary["steps"] = _steps_summary(Path(steps_path))
        # The engine's capacity: tokens computed per second of step time, idle gaps between arrivals
        # excluded (what a sweep over scheduling policies compares).
        if st.get("busy_s"):
            summary["throughput"]["busy_tokens_per_s"] = (st["prefill_tokens"] + st["decode_tokens"]) / st["busy_s"]
    if extra:
        summary.update(extra)
    kv_total = summary.get("kv_blocks_total")
    peak = summary.get("steps", {}).get("kv_blocks_peak")
    summary["kv_peak_fraction"] = peak / kv_total if kv_total and peak is not None else None
    return summary


def _steps_summary(path: Path) -> dict[str, Any]:
    t = pq.read_table(path, columns=["duration_s", "decode_tokens", "prefill_tokens", "kv_blocks_used",
                                     "num_forwards"])
    if t.num_rows == 0:
        return {"count": 0, "kv_blocks_peak": 0}
    dur = t.column("duration_s").to_numpy()
    tokens = (pc.add(t.column("decode_tokens"), t.column("prefill_tokens"))).to_numpy()
    return {
        "count": t.num_rows,
        "busy_s": float(dur.sum()),
        "duration_s": distribution(dur),
        "tokens_per_step_mean": float(tokens.mean()),
        "prefill_tokens": int(pc.sum(t.column("prefill_tokens")).as_py()),
        "decode_tokens": int(pc.sum(t.column("decode_tokens")).as_py()),
        "forwards": int(pc.sum(t.column("num_forwards")).as_py()),
        "kv_blocks_peak": int(pc.max(t.column("kv_blocks_used")).as_py()),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(s: dict[str, Any]) -> str:
    """The summary as a fixed-width text table (printed at the end of a run)."""
    tp = s["throughput"]
    lines = []
    title = "ladle summary"
    if s.get("model"):
        title += f"  model={s['model']}"
    if s.get("workload"):
        title += f"  workload={s['workload']}"
    if s.get("clock"):
        title += f"  clock={s['clock']}"
    lines.append(title)
    if s.get("complete") is False:
        lines.append("INCOMPLETE: the run was interrupted; the numbers cover the requests written so far")
        if s.get("resume_command"):
            lines.append(f"resume with: {s['resume_command']}")
    lines.append(f"requests      {s['requests']}  (completed {s['completed']}, errors {s['errors']}"
                 + (f", resumed {s['resumed']}" if s.get("resumed") else "")
                 + (f", {s['samples']} sample rows" if s.get("samples", s["requests"]) != s["requests"] else "")
                 + ")")
    lines.append(f"duration      {_num(s['duration_s'], '{:.3f}')} s")
    lines.append(f"throughput    {_num(tp['requests_per_s'])} req/s   input {_num(tp['input_tokens_per_s'], '{:.1f}')}"
                 f" tok/s   output {_num(tp['output_tokens_per_s'], '{:.1f}')} tok/s")
    lines.append("")
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{k:>10}" for k in STATS) + f"{'count':>9}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        d = s["latency_s"][name]
        lines.append(f"{name.upper():<14}" + "".join(f"{_ms(d[k]):>10}" for k in STATS) + f"{d['count']:>9}")
    lines.append("")
    steps = s.get("steps") or {}
    if steps.get("count"):
        peak = steps.get("kv_blocks_peak")
        total = s.get("kv_blocks_total")
        kv = f"{peak}" + (f" / {total} blocks ({100 * peak / total:.1f}%)" if total else " blocks")
        lines.append(f"peak KV       {kv}")
        lines.append(f"steps         {steps['count']}  (mean {_ms(steps['duration_s']['mean'])} ms, "
                     f"{steps['tokens_per_step_mean']:.1f} tokens/step)")
    lines.append(f"preemptions   {s['preemptions']}  ({s['preempted_requests']} requests)")
    hit = s.get("prefix_cache_hit_rate")
    tok = s["tokens"]
    lines.append(f"prefix cache  {_num(None if hit is None else 100 * hit, '{:.1f}')}% of prompt tokens "
                 f"({tok['cached_prompt']} / {tok['prompt']})")
    if s["errors"]:
        lines.append(f"errors        {s['errors']}  (see the error column of generations.parquet)")
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], path: Path) -> None:
    """summary.json through a .tmp and a rename; a failed write (a full disk) is an OutputError naming it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        # Cleaned like every text the job writes (runner/text.py): the overrides and paths come from argv.
        # Credentials in a URI or a credential variable's value an override quoted: masked (runner/redact.py).
        tmp.write_text(redact(json.dumps(clean(summary), indent=2, default=str)) + "\n")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"writing {path} failed ({e}); the run's Parquet files are complete. Free space or fix "
                          "the cause, then run the same command again: it writes the summary anew") from e
