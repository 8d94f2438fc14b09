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
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from runner.sinks import sample_indices

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


def summarize(gen_path: Path, steps_path: Path | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary dict of a run directory's generations.parquet (+ steps.parquet); `extra` is merged in."""
    pf = pq.ParquetFile(gen_path)
    columns = [c for c in GEN_COLUMNS if c in pf.schema_arrow.names]  # sample_index: files from before it
    itl, ttft, tpot, e2e, queue = [], [], [], [], []
    reasons: dict[str, int] = {}
    spans: dict[int, list[float]] = {}
    n = samples = errors = completed = prompt_tokens = output_tokens = cached = 0
    preemptions = preempted_requests = 0
    for batch in pf.iter_batches(batch_size=8192, columns=columns):
        t = pa.Table.from_batches([batch])
        # n samples of a row are n rows; the row's request (its prompt, prefilled once) is sample 0's.
        first = pa.array([k == 0 for k in sample_indices(t)], pa.bool_())
        samples += t.num_rows
        n += pc.sum(first.cast(pa.int64())).as_py() or 0
        fr = pc.fill_null(t.column("finish_reason"), "unknown").to_pylist()
        for r in fr:
            reasons[r] = reasons.get(r, 0) + 1
        ok = pa.array([r != "error" for r in fr], pa.bool_())
        errors += t.num_rows - pc.sum(ok.cast(pa.int64())).as_py() if t.num_rows else 0
        good = t.filter(ok)
        good_first = t.filter(pc.and_(ok, first))
        completed += good_first.num_rows
        prompt_tokens += pc.sum(good_first.column("prompt_tokens")).as_py() or 0
        output_tokens += pc.sum(good.column("output_tokens")).as_py() or 0
        cached += pc.sum(good_first.column("num_cached_tokens")).as_py() or 0
        pre = pc.fill_null(good.column("num_preemptions"), 0)
        preemptions += pc.sum(pre).as_py() or 0
        preempted_requests += pc.sum(pc.greater(pre, 0).cast(pa.int64())).as_py() or 0
        ttft.append(_floats(good, "ttft_s"))
        tpot.append(_floats(good, "tpot_s"))
        e2e.append(_floats(good, "e2e_s"))
        queue.append(_floats(good, "first_scheduled_s") - _floats(good, "arrival_s"))
        itl.append(itl_gaps(good.column("token_times_s")))
        attempts = t.column("attempt").to_numpy(zero_copy_only=False)
        arrival, finish = _floats(t, "arrival_s"), _floats(t, "finish_s")
        for a in np.unique(attempts):
            m = attempts == a
            lo, hi = np.nanmin(arrival[m], initial=math.inf), np.nanmax(finish[m], initial=-math.inf)
            s = spans.setdefault(int(a), [math.inf, -math.inf])
            s[0], s[1] = min(s[0], lo), max(s[1], hi)
    duration = sum(max(0.0, hi - lo) for lo, hi in spans.values() if hi >= lo)
    ok_requests = completed

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    summary: dict[str, Any] = {
        "requests": n,  # rows of the dataset (with sampling.n > 1, each has n sample rows)
        "samples": samples,  # generations rows
        "completed": ok_requests,
        "errors": errors,  # error rows
        "finish_reasons": dict(sorted(reasons.items())),
        "attempts": len(spans),
        "duration_s": duration,
        "throughput": {
            "requests_per_s": rate(ok_requests),
            "input_tokens_per_s": rate(prompt_tokens),
            "output_tokens_per_s": rate(output_tokens),
            "total_tokens_per_s": rate(prompt_tokens + output_tokens),
        },
        "tokens": {"prompt": prompt_tokens, "output": output_tokens, "cached_prompt": cached},
        "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "latency_s": {
            "ttft": distribution(np.concatenate(ttft) if ttft else np.zeros(0)),
            "itl": distribution(np.concatenate(itl) if itl else np.zeros(0)),
            "tpot": distribution(np.concatenate(tpot) if tpot else np.zeros(0)),
            "e2e": distribution(np.concatenate(e2e) if e2e else np.zeros(0)),
            "queue": distribution(np.concatenate(queue) if queue else np.zeros(0)),
        },
        "preemptions": preemptions,
        "preempted_requests": preempted_requests,
    }
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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)
