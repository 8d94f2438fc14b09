"""The OpenAI Batch API output file of a workload=openai_batch run, rebuilt from generations.parquet.

`batch_output.jsonl` in the run directory (the format `vllm run-batch` and OpenAI write), one line per
input line in input order:
    {"id": "batch_req_<line>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_<line>", "body": <chat.completion | text_completion>},
     "error": null}
and for a failed request `"response": {"status_code": 400, "request_id": ..., "body": null}` with
`"error": {"code": "invalid_request" | "generation_failed", "message": ...}`. The n samples of a request
are its `choices`. It is rebuilt at the end of every complete run (written to a .tmp, then renamed), so
a resumed run's file covers every line. The input side is runner/sources/openai_batch.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from runner.config import WorkloadConfig
from runner.sources.jsonl import jsonl_files
from runner.sources.openai_batch import CHAT_URL, BatchLine, parse_lines
from runner.text import clean

BATCH_OUTPUT = "batch_output.jsonl"

OUTPUT_COLUMNS = ["id", "sample_index", "prompt_tokens", "output_text", "output_token_ids", "output_tokens",
                  "finish_reason", "error", "logprobs", "top_logprobs"]


def _token(tokenizer: Any, tid: int) -> dict[str, Any]:
    text = tokenizer.decode([tid])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(r: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if r.get("logprobs") is None:
        return None
    content = []
    tops = r.get("top_logprobs") or [[] for _ in r["logprobs"]]
    for tid, lp, top in zip(r["output_token_ids"], r["logprobs"], tops, strict=False):
        content.append({**_token(tokenizer, tid), "logprob": lp,
                        "top_logprobs": [{**_token(tokenizer, t["token_id"]), "logprob": t["logprob"]}
                                         for t in (top or [])]})
    return {"content": content}


def _completion_logprobs(r: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if r.get("logprobs") is None:
        return None
    tokens = [tokenizer.decode([t]) for t in r["output_token_ids"]]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = r.get("top_logprobs") or [[] for _ in tokens]
    return {"tokens": tokens, "token_logprobs": list(r["logprobs"]), "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([t["token_id"]]): t["logprob"] for t in (top or [])} for top in tops]}


def _body(line: BatchLine, samples: list[dict[str, Any]], model: str, created: int, tokenizer: Any) -> dict:
    chat = line.url == CHAT_URL
    choices = []
    for k, r in enumerate(samples):
        choice: dict[str, Any] = {"index": k, "finish_reason": r["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": r["output_text"]}
            choice["logprobs"] = _chat_logprobs(r, tokenizer)
        else:
            choice["text"] = r["output_text"]
            choice["logprobs"] = _completion_logprobs(r, tokenizer)
        choices.append(choice)
    prompt = samples[0]["prompt_tokens"] or 0
    completion = sum(r["output_tokens"] or 0 for r in samples)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line.lineno}", "object": "chat.completion" if chat
            else "text_completion", "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
            "response": {"status_code": 400, "request_id": f"req_{line.lineno}", "body": None},
            "error": {"code": code, "message": message}}


def write_batch_output(workload: WorkloadConfig, gen_path: Path, out_path: Path, tokenizer: Any, model: str) -> Path:
    """The output JSONL for the input file(s) of `workload`, from generations.parquet, written atomically."""
    rows: dict[str, list[dict[str, Any]]] = {}
    pf = pq.ParquetFile(gen_path)
    for batch in pf.iter_batches(columns=OUTPUT_COLUMNS):
        for r in batch.to_pylist():
            rows.setdefault(r["id"], []).append(r)
    created = int(time.time())
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in parse_lines(jsonl_files(workload), workload.limit):
            if line.error:
                out = _error_line(line, "invalid_request", line.error)
            else:
                got = {r["sample_index"] or 0: r for r in rows.get(line.row_id, [])}
                samples = [got[k] for k in sorted(got)]
                ok = [r for r in samples if r["finish_reason"] != "error"]
                if not ok:
                    message = samples[0]["error"] if samples else "no output was written for this request"
                    out = _error_line(line, "invalid_request" if samples else "generation_failed", message)
                else:
                    out = {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
                           "response": {"status_code": 200, "request_id": f"req_{line.lineno}",
                                        "body": _body(line, ok, model, created, tokenizer)},
                           "error": None}
            fh.write(json.dumps(clean(out), ensure_ascii=False) + "\n")  # the sink's own defence (runner/text.py)
    os.replace(tmp, out_path)
    return out_path
