"""The rows the job writes: a generations row per finished sample (or failed request) and a steps row
per engine step. Times are seconds from the job's start (`t0`, on the engine's clock)."""

from __future__ import annotations

import math
from typing import Any

from ladle.runner.requests import Pending


def request_columns(p: Pending, include_prompt: bool) -> dict[str, Any]:
    """The columns every generations row of a request has."""
    row = {"id": p.row.id, "index": p.row.index, "class": p.row.klass, "sample_index": 0}
    if include_prompt:
        row["prompt"] = p.text
    return row


def error_columns(p: Pending) -> dict[str, Any]:
    """A request that never ran: the row's error, no tokens."""
    arrival = None if math.isnan(p.arrival) else p.arrival
    return {"prompt_tokens": None if p.token_ids is None else len(p.token_ids), "output_text": "",
            "output_token_ids": [], "output_tokens": 0, "finish_reason": "error", "error": p.error,
            "arrival_s": arrival, "finish_s": arrival, "token_times_s": [], "num_prefill_chunks": 0,
            "num_preemptions": 0, "num_cached_tokens": 0}


def unwritable_row(row: dict[str, Any], error: Exception) -> dict[str, Any]:
    """What generations.parquet gets instead of a row pyarrow cannot encode: an error row of the same
    request and sample (what identifies it kept when it can be written; the token count too, so resume
    still tells a sample that drew tokens from a request that failed before its fork)."""
    def kept(key: str, cast: type) -> Any:
        try:
            return None if row.get(key) is None else cast(row[key])
        except (TypeError, ValueError):
            return None

    out = {"id": kept("id", str), "index": kept("index", int), "class": kept("class", str),
           "sample_index": kept("sample_index", int) or 0, "attempt": kept("attempt", int),
           "prompt_tokens": kept("prompt_tokens", int), "output_tokens": kept("output_tokens", int) or 0}
    return {**out, "output_text": "", "output_token_ids": [], "token_times_s": [], "finish_reason": "error",
            "error": f"this row could not be written to generations.parquet ({type(error).__name__}: {error})"}


def output_columns(o: Any, t0: float) -> dict[str, Any]:
    """One finished output of the engine (a sample of a request)."""
    m = o.metrics
    times = [t - t0 for t in m.token_times]
    first_token = _rel(m.first_token_time, t0)
    arrival = m.arrival_time - t0
    finish = _rel(m.finish_time, t0)
    return {
        "prompt_tokens": len(o.prompt_token_ids), "output_text": o.text,
        "output_token_ids": list(o.output_token_ids), "output_tokens": len(o.output_token_ids),
        "finish_reason": o.finish_reason, "error": o.error, "arrival_s": arrival,
        "first_scheduled_s": _rel(m.first_scheduled_time, t0), "first_token_s": first_token,
        "finish_s": finish, "token_times_s": times,
        "ttft_s": None if first_token is None else first_token - arrival,
        "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "e2e_s": None if finish is None else finish - arrival,
        "num_prefill_chunks": m.num_prefill_chunks, "num_preemptions": m.num_preemptions,
        "num_cached_tokens": m.num_cached_tokens, "sample_index": getattr(o, "sample_index", 0) or 0,
        **_logprob_columns(o),
    }


def step_columns(s: Any, t0: float, arrived: int) -> dict[str, Any]:
    """One engine step (`LLMEngine.last_step`); `arrived`: requests added since the previous step."""
    return {
        "step": s.step, "start_s": s.start_time - t0, "duration_s": s.duration,
        "decode_tokens": s.decode_tokens, "prefill_tokens": s.prefill_tokens,
        "prefill_requests": s.prefill_requests, "running": s.running, "waiting": s.waiting,
        "kv_blocks_used": s.kv_blocks_used, "cached_prompt_tokens": s.cached_prompt_tokens,
        "num_forwards": s.num_forwards, "arrived": arrived,
        "scheduled_ids": list(s.scheduled), "scheduled_tokens": list(s.scheduled.values()),
        "preempted": list(s.preempted), "failed": list(s.failed),
    }


def _top(pairs: list[list[tuple[int, float]]] | None) -> list[list[dict[str, Any]]] | None:
    if pairs is None:
        return None
    return [[{"token_id": t, "logprob": lp} for t, lp in pos] for pos in pairs]


def _logprob_columns(o: Any) -> dict[str, Any]:
    """The logprob columns of one finished output (null where not asked for)."""
    return {"logprobs": getattr(o, "logprobs", None), "top_logprobs": _top(getattr(o, "top_logprobs", None)),
            "prompt_logprobs": getattr(o, "prompt_logprobs", None),
            "prompt_top_logprobs": _top(getattr(o, "prompt_top_logprobs", None))}


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0
