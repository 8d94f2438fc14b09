"""A request's (or one sample's) grammar: the shared compile, its own xgrammar matcher, and what the
engine learns at each step (failed, exhausted, may end). The manager that fills and advances many of
them at once is engine/structured_output.py."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ladle.engine.grammar_spec import compile_error


def _allows_any(matcher: Any, grammar: Any) -> bool:
    """Whether the matcher's next-token mask allows any token (one fill, on a fresh matcher)."""
    import xgrammar as xgr

    vocab = grammar.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


@dataclass(eq=False)
class GrammarState:
    """A request's (or a sample's) grammar: the shared compile and its own matcher."""

    kind: str
    compiled: Future
    stop_ids: list[int]  # the model's EOS ids and the request's own stop_token_ids
    own_stop_ids: list[int] = field(default_factory=list)  # the request's, not among the EOS ids
    matcher: Any = None
    error: str | None = None  # set when the compile failed: the request fails with it
    exhausted: bool = False  # complete, with nothing further allowed (only when it has no stop token)
    after_ed: bool = False  # the text so far ends with the lead byte ED (see VocabMasks)
    # Without a stop token, a complete grammar that could go on is not masked: a token it would take
    # continues it, any other token is the model choosing to end here (the packed allowed tokens).
    may_end: torch.Tensor | None = None

    def ready(self) -> bool:
        """Make the matcher (waiting for the compile if needed). False if the compile failed."""
        if self.matcher is None and self.error is None:
            import xgrammar as xgr

            try:
                grammar = self.compiled.result()
            except Exception as exc:  # noqa: BLE001 - any compile failure is this request's error
                self.error = compile_error(self.kind, exc)
                return False
            try:
                if self.stop_ids:
                    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=self.stop_ids)
                else:  # no stop token: the grammar ends when it allows nothing more or the model ends it
                    matcher = xgr.GrammarMatcher(grammar)
                if not matcher.is_completed() and not _allows_any(matcher, grammar):
                    # Known before any prefill: a grammar whose language is empty (or that no token of
                    # this vocabulary can begin) would otherwise fail after it, blaming its stop tokens.
                    self.error = self._no_first_token(grammar)
                else:
                    self.matcher = matcher
            except Exception as exc:  # noqa: BLE001 - e.g. a stop id the grammar's vocabulary lacks
                self.error = f"{self.kind} cannot start: {type(exc).__name__}: {exc}"
        return self.error is None

    def _no_first_token(self, grammar: Any) -> str:
        """Why a grammar allows no first token. The request's own stop_token_ids are taken out of the
        grammar's vocabulary (they end the request, they are not text): when the grammar can begin
        without that (a matcher with the EOS ids only), they are the cause; else its language is empty."""
        import xgrammar as xgr

        if self.own_stop_ids:
            eos = sorted(set(self.stop_ids).difference(self.own_stop_ids))
            plain = xgr.GrammarMatcher(grammar, override_stop_tokens=eos) if eos else xgr.GrammarMatcher(grammar)
            if plain.is_completed() or _allows_any(plain, grammar):
                return (f"{self.kind} allows no first token: its stop_token_ids {self.own_stop_ids} are not "
                        f"text to it; remove them if the {self.kind} needs them")
        return f"{self.kind} matches no text: it allows no first token; fix the {self.kind}"

    def fresh(self) -> GrammarState:
        """A new matcher over the same compile (each of a request's n samples has its own)."""
        return GrammarState(self.kind, self.compiled, self.stop_ids, self.own_stop_ids)
