"""The OpenAI Batch API output file of a workload=openai_batch run, rebuilt from generations.parquet.

`batch_output.jsonl` in the run directory (the format `vllm run-batch` and OpenAI write), one line per
input line in input order:
    {"id": "batch_req_<line>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_<line>", "body": <chat.completion | text_completion>},
     "error": null}
and for a failed request `"response": {"status_code": 400, "request_id": ..., "body": null}` with
`"error": {"code": "invalid_request" | "generation_failed", "message": ...}`. The n samples of a request
are its `choices`, each at its own sample index; a sample that failed while others did not is a choice
with `finish_reason: "error"` and its `error`, counted in `usage`, and the line's `error` says which
failed and why (code `samples_failed`). Rows are found by the line's row index (a line without a
custom_id has none). It is rebuilt at the end of every complete run (written to a .tmp, then renamed), so
a resumed run's file covers every line. The input side is runner/sources/openai_batch.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from ladle.runner.batch_logprobs import Echo, chat_logprobs, completion_logprobs
from ladle.runner.config import WorkloadConfig
from ladle.runner.sources.jsonl import jsonl_files
from ladle.runner.sources.openai_batch import CHAT_URL, BatchLine, parse_lines
from ladle.runner.text import clean

BATCH_OUTPUT = "batch_output.jsonl"

OUTPUT_COLUMNS = ["id", "index", "sample_index", "prompt_tokens", "output_text", "output_token_ids", "output_tokens",
                  "finish_reason", "error", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"]


def _choice(line: BatchLine, k: int, r: dict[str, Any] | None, tokenizer: Any, echo: Echo | None) -> dict:
    """Sample k's choice; r None: no row was written for it."""
    failed = r is None or r["finish_reason"] == "error"
    text = "" if r is None else r["output_text"] or ""
    choice: dict[str, Any] = {"index": k, "finish_reason": "error" if r is None else r["finish_reason"]}
    if line.url == CHAT_URL:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None if failed else chat_logprobs(r, tokenizer)
    else:
        choice["text"] = text if echo is None else echo.text + text
        choice["logprobs"] = None if failed else completion_logprobs(r, tokenizer, echo, "logprobs" in line.sampling)
    if failed:
        choice["error"] = {"code": "generation_failed",
                           "message": "no output was written for this sample" if r is None else r["error"]}
    return choice


def _body(line: BatchLine, got: dict[int, dict[str, Any]], n: int, model: str, created: int, tokenizer: Any,
          echo: Echo | None) -> dict[str, Any]:
    chat = line.url == CHAT_URL
    choices = [_choice(line, k, got.get(k), tokenizer, echo) for k in sorted({*got, *range(n)})]
    prompt = next((r["prompt_tokens"] for r in got.values() if r["prompt_tokens"]), 0)
    completion = sum(r["output_tokens"] or 0 for r in got.values())  # every sample's, the failed ones too
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line.lineno}", "object": "chat.completion" if chat
            else "text_completion", "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _samples_failed(choices: list[dict[str, Any]]) -> dict[str, str] | None:
    bad = [c for c in choices if "error" in c]
    if not bad:
        return None
    why = "; ".join(f"sample {c['index']}: {str(c['error']['message'])[:200]}" for c in bad)
    return {"code": "samples_failed", "message": f"{len(bad)} of {len(choices)} samples failed: {why}"}


def _error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
            "response": {"status_code": 400, "request_id": f"req_{line.lineno}", "body": None},
            "error": {"code": code, "message": message}}


def _samples_asked(line: BatchLine) -> int:
    from ladle.runner.sampling import BadValue, as_int

    try:
        return max(1, as_int(line.sampling.get("n", 1)))
    except BadValue:
        return 1


def _echo(line: BatchLine, workload: WorkloadConfig, tokenizer: Any) -> Echo | None:
    """The prompt as the run encoded it (runner/prompts.py), for a completions line with echo."""
    from ladle.runner.prompts import encode_prompt

    if not line.echo:
        return None
    w = workload
    enc = encode_prompt(line.prompt, w.prompt_format, tokenizer, w.chat_template, "body.prompt", w.chat_template_kwargs)
    ids = enc.token_ids or []
    return Echo(line.prompt if isinstance(line.prompt, str) else tokenizer.decode(ids), ids)


def _output_line(line: BatchLine, rows: list[dict[str, Any]], workload: WorkloadConfig, tokenizer: Any,
                 model: str, created: int) -> dict[str, Any]:
    if line.error:
        return _error_line(line, "invalid_request", line.error)
    got = {r["sample_index"] or 0: r for r in rows}
    if not any(r["finish_reason"] != "error" for r in got.values()):
        first = got[min(got)] if got else None
        return _error_line(line, "invalid_request" if first else "generation_failed",
                           first["error"] if first else "no output was written for this request")
    body = _body(line, got, _samples_asked(line), model, created, tokenizer, _echo(line, workload, tokenizer))
    return {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{line.lineno}", "body": body},
            "error": _samples_failed(body["choices"])}


# Characters JSON keeps raw in strings that line splitters (Python's str.splitlines among them) take for
# line ends: escaped, so every output line is one line to any reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _jsonl(obj: dict[str, Any]) -> str:
    """One output line: its text cleaned (the sink's own defence, runner/text.py), line breaks escaped."""
    return json.dumps(clean(obj), ensure_ascii=False).translate(_LINE_BREAKS)


def write_batch_output(workload: WorkloadConfig, gen_path: Path, out_path: Path, tokenizer: Any, model: str) -> Path:
    """The output JSONL for the input file(s) of `workload`, from generations.parquet, written atomically."""
    rows: dict[int, list[dict[str, Any]]] = {}  # by row index: the line's (ids may be missing or repeated)
    pf = pq.ParquetFile(gen_path)
    columns = [c for c in OUTPUT_COLUMNS if c in pf.schema_arrow.names]
    for batch in pf.iter_batches(columns=columns):
        for r in batch.to_pylist():
            rows.setdefault(r["index"], []).append(r)
    created = int(time.time())
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in parse_lines(jsonl_files(workload), workload.limit):
            out = _output_line(line, rows.get(line.lineno - 1, []), workload, tokenizer, model, created)
            fh.write(_jsonl(out) + "\n")
    os.replace(tmp, out_path)
    return out_path
