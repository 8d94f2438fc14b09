"""The output side of a request: its text, when its tokens end it, and what each step reports.

Per sequence (each of a request's n samples has its own) a detokenizer state turns tokens into text
deltas (engine/detokenizer.py). Text is built as it comes only when someone reads it per step
(output_kind "delta") or a stop string must be found; otherwise the final flush decodes the whole
output once. A stop string cuts the text where it starts; while one could still complete, its
possible start is held back, so the reported deltas always add up to the final text. Every ending
(stop, length, error, abort) flushes what the detokenizer held back (an incomplete character,
clean-up pending text), except a stop string's cut: what lies past it is not text.
"""

from __future__ import annotations

import logging

from ladle.engine.detokenizer import Detokenizer, DetokState, find_stop
from ladle.engine.request import Request, RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detok: dict[Request, DetokState] = {}

    # -- sequences -------------------------------------------------------------------------------
    def start(self, req: Request) -> None:
        """A new sequence (an admitted request, or a forked sample): its text starts at the output."""
        self._detok[req] = DetokState.for_prompt(req.num_prompt_tokens, req.params.skip_special_tokens)

    def drop(self, req: Request) -> None:
        self._detok.pop(req, None)

    # -- a sampled token -------------------------------------------------------------------------
    def take_token(self, req: Request, token: int, grammar_ended: bool) -> str | None:
        """The text of the token just appended, and whether it ends the request: "stop" (its grammar
        ended, EOS, a stop token, a stop string), "length" (max_tokens, max_model_len) or None. As in
        vLLM, EOS, stop tokens and stop strings end nothing before min_tokens (stop strings only past
        it), and a stop token's own text is not output unless include_stop_str_in_output (or a grammar
        took it)."""
        p = req.params
        n = len(req.output_token_ids)
        stop_token = (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
        reason = "stop" if grammar_ended or (stop_token and n >= p.min_tokens) else None
        if reason is None and (n >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        # A grammar's stop token keeps its text: the grammar may need it (docs/ARCHITECTURE.md).
        hide = reason == "stop" and stop_token and not grammar_ended and not p.include_stop_str_in_output
        shown = req.output_token_ids[:-1] if hide else req.output_token_ids
        # Text is built as it comes only when it is read per step or a stop string must be found.
        streamed = p.output_kind == "delta" or bool(p.stop)
        new_text = ""
        if streamed and not hide:
            new_text = self.detokenizer.step(self._detok[req], req.prompt_token_ids, shown)
        if reason is not None:  # the last text now: stop strings are checked on it
            new_text += self.detokenizer.flush(self._detok.pop(req), req.prompt_token_ids, shown)
        req.text += new_text
        if p.stop and n > p.min_tokens:
            cut = find_stop(req.text, len(new_text), p.stop, p.include_stop_str_in_output)
            if cut is not None:
                req.text = req.text[:cut]
                reason = "stop"
                self._detok.pop(req, None)  # what it holds back lies past the stop string: no text
        return reason

    def flush(self, req: Request) -> None:
        """At any ending: the text held back (or, final_only, never decoded) joins the text."""
        detok = self._detok.pop(req, None)
        if detok is None:
            return
        try:
            tail = self.detokenizer.flush(detok, req.prompt_token_ids, req.output_token_ids)
        except Exception as exc:  # noqa: BLE001 - the detokenizer is what failed this request
            log.debug("request %s: final text not flushed: %s", req.request_id, exc)
            return
        req.text += tail
        p = req.params
        if p.stop and len(req.output_token_ids) > p.min_tokens:  # the released text is text too
            cut = find_stop(req.text, len(tail), p.stop, p.include_stop_str_in_output)
            if cut is not None:
                req.text = req.text[:cut]

    # -- outputs ---------------------------------------------------------------------------------
    def token_output(self, req: Request, token: int, reason: str | None) -> RequestOutput | None:
        """The step's output for a request that took a token (None for an unfinished final_only one).
        While a stop string could still complete, its possible start is held back."""
        p = req.params
        visible = len(req.text)
        if p.stop and reason is None:
            visible -= max(len(x) for x in p.stop) - 1
        emitted = req.num_emitted_chars
        req.num_emitted_chars = max(emitted, visible)
        if reason is None and p.output_kind == "final_only":
            return None
        return self.output(req, [token], req.text[emitted : req.num_emitted_chars])

    def ended_output(self, req: Request) -> RequestOutput:
        """The output of a request that ended without a new token (failed, stuck, aborted, ended by its
        grammar): whatever text was held back is released."""
        emitted = req.num_emitted_chars
        req.num_emitted_chars = len(req.text)
        return self.output(req, [], req.text[emitted:])

    @staticmethod
    def output(req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        if getattr(req.params, "output_kind", "delta") == "final_only":  # its one output: all of it is new
            new_ids, new_text = list(req.output_token_ids), req.text[: req.num_emitted_chars]
        with_logprobs = getattr(req.params, "logprobs", None) is not None
        with_prompt_logprobs = getattr(req.params, "prompt_logprobs", None) is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,  # no copy per step: see RequestOutput
            text=req.text[: req.num_emitted_chars],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            metrics=req.metrics,
            sample_index=req.sample_index,
            # Not copies, like output_token_ids: the request's own lists, extended by later steps.
            logprobs=req.logprobs if with_logprobs else None,
            top_logprobs=req.top_logprobs if with_logprobs else None,
            # Complete once the prefill is done and never changed afterwards.
            prompt_logprobs=req.prompt_logprobs if with_prompt_logprobs else None,
            prompt_top_logprobs=req.prompt_top_logprobs if with_prompt_logprobs else None,
        )
