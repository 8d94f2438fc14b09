"""The input side of add_request: tokenise, validate, start the grammar's compile, make the Request.

Bad input never raises: the request is made anyway, finished with finish_reason "error" and a message
saying what to fix, and the engine reports it from its next step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Container, Sequence

from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Request, RequestMetrics, RequestStatus
from ladle.engine.sampling_params import SamplingParams, StructuredOutputs
from ladle.engine.structured_output import StructuredOutputManager, schema_text


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv: KVCacheManager,
                 structured: StructuredOutputManager, seed_unseeded: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.structured = structured
        # Deterministic mode: a request without a seed gets one derived from the engine's seed and its
        # id, so its draws are its own (the engine's shared generator is consumed in batch order).
        self.seed_unseeded = seed_unseeded
        self._ids = itertools.count()
        self._order = itertools.count()

    def request_id(self, request_id: str | None, in_use: Container[str]) -> str:
        """The id given, or the next number no request holds (a caller's own ids may be numbers too)."""
        if request_id is not None:
            return str(request_id)
        rid = str(next(self._ids))
        while rid in in_use:
            rid = str(next(self._ids))
        return rid

    def process(self, request_id: str, prompt: Sequence[int] | str, params: SamplingParams,
                arrival_time: float) -> Request:
        """A new request; a refused one comes back finished, with its error."""
        error = None
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this request's error
            ids, error = [], f"could not tokenize the prompt: {exc}"
        if isinstance(params, SamplingParams):
            # The request's own copy: a caller that reuses one object for several requests (changing
            # its seed between them) or edits it later must not change a queued request, nor skip the
            # validation below (vLLM clones the params too).
            try:
                params = own_copy(params)
            except Exception as exc:  # noqa: BLE001 - e.g. a schema nested past the recursion limit
                schema = getattr(params.structured, "json_schema", None)
                fix = ("; give structured.json_schema as JSON text, or a dict of JSON values (str keys) "
                       "nested less deeply" if isinstance(schema, dict) else "")
                error = error or f"invalid sampling params: they cannot be copied ({type(exc).__name__}: {exc}){fix}"
        if self.seed_unseeded is not None and isinstance(params, SamplingParams) and params.seed is None:
            params = dataclasses.replace(params, seed=derived_seed(self.seed_unseeded, request_id))
        if isinstance(params, SamplingParams) and params.max_tokens is None:  # vLLM: up to max_model_len
            room = max(self.max_model_len - len(ids), 1)
            # A min_tokens past the room is no error (no max_tokens was set): stop tokens stay masked to the end.
            min_tokens = min(params.min_tokens, room) if isinstance(params.min_tokens, int) else params.min_tokens
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min_tokens)
        req = Request(request_id, ids, params, RequestMetrics(arrival_time=arrival_time), index=next(self._order))
        try:
            error = error or self.validate(req)
            if error is None and params.structured is not None:  # compile starts now, off the step's path
                error = self.structured.submit(req)
        except Exception as exc:  # noqa: BLE001 - e.g. a params object of the wrong kind
            error = f"invalid request: {type(exc).__name__}: {exc}"
        if error:
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.error = "error", error
        return req

    def validate(self, req: Request) -> str | None:
        """What is wrong with the request (None: nothing): its params, its prompt, its length."""
        problems = req.params.problems()
        if problems:
            return "invalid sampling params: " + "; ".join(problems)
        n = req.num_prompt_tokens
        if n == 0:
            return "empty prompt: give at least one token"
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        bad = [t for t in req.params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return (f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                    f"remove them")
        bad = [t for t in req.params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad:
            return f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); remove them"
        total = n + req.params.max_tokens
        if total > self.max_model_len:
            return (
                f"prompt of {n} tokens + max_tokens={req.params.max_tokens} exceeds max_model_len="
                f"{self.max_model_len}; shorten the prompt, lower max_tokens or raise cache.max_model_len"
            )
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            return (
                f"prompt of {n} tokens + max_tokens={req.params.max_tokens} needs "
                f"{self.kv.blocks_needed(total)} KV blocks but the cache has "
                f"{self.kv.num_blocks}; raise cache.num_blocks or cache.memory_gb"
            )
        return None


def own_copy(params: SamplingParams) -> SamplingParams:
    """A copy of the params that shares nothing mutable with the caller's: the lists copied, a dict
    json_schema frozen as its JSON text (what the compile and the cache key read anyway: the same
    grammar, key and refusals; a deep copy of a large schema cost 4x the key's json.dumps per request).
    A field of the wrong type is kept as it is: validation refuses it, naming it. Raises when the
    schema is not JSON (TypeError) or nested past the recursion limit (RecursionError)."""

    def copied(value: object) -> object:
        return list(value) if isinstance(value, (list, tuple)) else value

    so = params.structured
    if isinstance(so, StructuredOutputs):
        schema = so.json_schema
        so = dataclasses.replace(so, json_schema=schema_text(schema) if isinstance(schema, dict) else schema,
                                 choice=copied(so.choice))
    bias = params.logit_bias
    return dataclasses.replace(params, stop=copied(params.stop), stop_token_ids=copied(params.stop_token_ids),
                               structured=so, logit_bias=dict(bias) if isinstance(bias, dict) else bias)


def derived_seed(engine_seed: int, request_id: str) -> int:
    """A request's own seed from the engine's and its id (sha256: stable across processes and runs)."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") >> 1
