"""Structured output: a request's json_schema / regex / choice / grammar becomes a token mask.

xgrammar compiles each spec against the engine's vocabulary (a TokenizerInfo built once, the first
time a request asks for structured output) into a grammar whose matcher says, at every step, which
tokens may come next. The engine uses three hooks:

- `submit(req)` at add_request: the compile starts on a background thread (one per engine), cached
  per spec (the key is the spec's canonical JSON), so the same schema is compiled once and a request
  arriving while its schema compiles shares that compile.
- `apply_masks(logits, requests)` right before Sampler.sample: the sampling rows with a grammar get
  one batched bitmask (tokens the grammar forbids, the model's padding ids beyond the tokenizer's
  vocabulary among them, set to -inf), so greedy, temperature and top-k/p/min-p all choose within the
  grammar. A request whose compile is still running is waited for here, on its first sampling step
  only (its prefill ran meanwhile).
- `accept(req, token)` when the engine appends a sampled token: the request's matcher advances;
  "stop" once the grammar is complete and took a stop token (EOS or the request's stop_token_ids).
  Only sampled tokens are accepted: a preempted request recomputes its KV from tokens it already has
  and samples nothing new until it catches up, so its matcher is never advanced twice.

A spec that does not compile fails its own request only (finish_reason "error", the compiler's message).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ladle.engine.grammar_spec import (  # the spec functions, importable from here too
    INSTALL_HINT,
    cache_key,
    choice_grammar,
    schema_text,
    spec_error,
    spec_of,
)
from ladle.engine.grammar_state import GrammarState
from ladle.engine.grammar_vocab import VocabMasks, VocabularyError, tokenizer_info
from ladle.engine.json_schema_support import json_schema_problem
from ladle.engine.request import Request
from ladle.engine.sampling_params import StructuredOutputs

__all__ = ["GrammarState", "StructuredOutputManager", "cache_key", "choice_grammar", "schema_text", "spec_error"]

CACHE_SIZE = 256  # compiled specs kept (one grammar's token-mask cache can be megabytes)

class StructuredOutputManager:
    """Compiles specs (cached, on a background thread) and masks/advances requests' grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], xgrammar_threads: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self.eos_ids = sorted(eos_ids)
        # Threads of xgrammar's compiler and of the batched mask fill (half the cores, at most 8).
        self.xgrammar_threads = xgrammar_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._compiler = None
        self._masks: VocabMasks | None = None  # set with the compiler
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Compiles by spec, least recently used first (requests hold their own reference to theirs).
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pending: list[Request] = []  # submitted, compile not yet seen to finish
        self._filler = None  # xgrammar.BatchGrammarMatcher: fills many rows' masks on its own threads
        self.num_compiles = 0  # distinct specs compiled (or being compiled)

    @property
    def in_use(self) -> bool:
        """Whether any request ever asked for structured output (else the per-step hooks do nothing)."""
        return bool(self._cache)

    # -- compiling -------------------------------------------------------------------------------
    def submit(self, req: Request) -> str | None:
        """Start compiling req's spec (or share a compile of the same spec). Returns an error message
        when structured output cannot be served at all (xgrammar missing)."""
        so = req.params.structured
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            return INSTALL_HINT
        kind, value = spec_of(so)
        key = cache_key(so)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
        else:
            if kind == "json_schema" and (problem := json_schema_problem(value)):
                return problem  # a schema the grammar would not enforce: refused, never a wrong "stop"
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladle-grammar")
            future = self._pool.submit(self._compile, so)
            self._cache[key] = future
            self.num_compiles += 1
            if len(self._cache) > CACHE_SIZE:  # many per-row schemas: memory stays bounded
                self._cache.popitem(last=False)
        stop_ids = sorted(set(self.eos_ids) | set(req.params.stop_token_ids))
        own = sorted(set(req.params.stop_token_ids).difference(self.eos_ids))
        req.grammar = GrammarState(kind, future, stop_ids, own)
        self._pending.append(req)
        return None

    def _compile(self, so: StructuredOutputs):
        with self._lock:  # the TokenizerInfo is built once, on this thread, off the step's path
            if self._compiler is None:
                import xgrammar as xgr

                try:
                    info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
                    self._masks = VocabMasks.build(info, self.vocab_size, self.eos_ids)
                except Exception as exc:  # reported as what it is, not as a bad spec
                    raise VocabularyError(f"{type(exc).__name__}: {exc}") from exc
                # xgrammar's own cache is off: this class's bounded cache is the one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.xgrammar_threads, cache_enabled=False)
        kind, value = spec_of(so)
        if kind == "json_schema":
            # Compact JSON (", " and ": " separators, no free whitespace): a model cannot spend its
            # token budget on whitespace, a known failure of unconstrained-whitespace JSON grammars.
            return self._compiler.compile_json_schema(schema_text(value), any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(value)
        if kind == "choice":
            return self._compiler.compile_grammar(choice_grammar(list(value)))
        return self._compiler.compile_grammar(value)

    def take_failed(self) -> list[Request]:
        """Unfinished requests whose compile has failed since the last call: the engine fails them
        before spending a prefill on them."""
        failed, pending = [], []
        for req in self._pending:
            g = req.grammar
            if req.finished or g.matcher is not None or g.error is not None:
                continue
            if not g.compiled.done():
                pending.append(req)
            elif not g.ready():
                failed.append(req)
        self._pending = pending
        return failed

    # -- per step --------------------------------------------------------------------------------
    def apply_masks(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask the logits rows (one per request, in order) of requests with a grammar, in place.
        Rows of failed or exhausted grammars are left alone: the engine ends those requests instead
        of appending their token (see verdict)."""
        import xgrammar as xgr

        rows, states = [], []
        for i, req in enumerate(requests):
            g = req.grammar
            if g is not None and g.ready():
                rows.append(i)
                states.append(g)
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        rows, states = self._fill(bitmask, rows, states)
        if not rows:
            return
        # The rest is batched over the grammar rows (per-row tensor ops would cost more than the fills).
        index = torch.tensor(rows)
        masks = bitmask[index]
        exhausted = ~masks.any(dim=1)  # nothing allowed: the grammar is complete and has no stop token
        codes = torch.tensor([(g.kind == "json_schema") + 2 * g.after_ed for g in states])
        stops = _stop_bits(masks, states, self.eos_ids)  # a request's stop tokens pass the table
        masks &= self._masks.table[codes]
        masks |= stops
        stuck = ~masks.any(dim=1) & ~exhausted
        bitmask[index] = masks
        keep = [i for j, (i, g, ex, st) in enumerate(zip(rows, states, exhausted.tolist(), stuck.tolist()))
                if _judge_row(g, masks[j], ex, st)]
        if keep:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=keep
            )

    @staticmethod
    def verdict(req: Request, token: int) -> tuple[str, str | None] | None:
        """(finish_reason, error) when the request must end instead of taking its sampled token: its
        grammar failed, allows nothing more, or is complete and the model drew a token it would not
        take (the model's choice to end: a grammar without stop tokens)."""
        g = req.grammar
        if g is None:
            return None
        if g.error is not None:
            return "error", g.error
        if g.exhausted:
            return "stop", None
        if g.may_end is not None and not (int(g.may_end[token >> 5]) >> (token & 31)) & 1:
            return "stop", None
        return None

    def _fill(self, bitmask: torch.Tensor, rows: list[int], states: list[GrammarState]):
        """Fill the rows' masks (batched); a grammar whose fill raises fails alone (its error is set
        and its row is left out), the others are filled one by one."""
        import xgrammar as xgr

        try:
            if len(rows) == 1:
                states[0].matcher.fill_next_token_bitmask(bitmask, rows[0])
            else:
                if self._filler is None:
                    self._filler = xgr.BatchGrammarMatcher(max_threads=self.xgrammar_threads)
                self._filler.batch_fill_next_token_bitmask([g.matcher for g in states], bitmask, indices=rows)
            return rows, states
        except Exception:  # noqa: BLE001 - find the grammar at fault; the rest go on
            kept_rows, kept = [], []
            for i, g in zip(rows, states):
                try:
                    g.matcher.fill_next_token_bitmask(bitmask, i)
                    kept_rows.append(i)
                    kept.append(g)
                except Exception as exc:  # noqa: BLE001
                    g.error = f"{g.kind} failed: {type(exc).__name__}: {exc}"
            return kept_rows, kept

    def accept(self, req: Request, token: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar has ended.
        A token the mask allowed is always accepted; a rejection would mean the mask and the matcher
        disagree, so it is an error rather than an output that silently breaks the spec."""
        g = req.grammar
        if g is None or not g.ready():
            return False
        if not g.matcher.accept_token(token):
            raise RuntimeError(f"the {g.kind} grammar rejected token {token}, which its mask allowed")
        g.after_ed = token in self._masks.ends_with_ed
        return g.matcher.is_terminated()


def _judge_row(g: GrammarState, mask: torch.Tensor, exhausted: bool, stuck: bool) -> bool:
    """Record on the grammar what its row's final mask says; True when the row is to be masked (the
    grammar goes on), False when the engine ends the request instead (see verdict)."""
    g.may_end = None
    if not exhausted and not stuck and not g.stop_ids and g.matcher.is_completed():
        g.may_end = mask.clone()  # complete, could go on: the model decides (see verdict)
        return False
    if exhausted and g.stop_ids:
        # A complete grammar allows its stop tokens, so an empty mask means it is stuck short of
        # complete: a token it needs is one of the request's own stop_token_ids (those are taken
        # out of the grammar's vocabulary), or no token can continue it at all.
        own = g.own_stop_ids
        g.error = (f"{g.kind} cannot continue: no token of the vocabulary continues it here"
                   + (f" (its stop_token_ids {own} are not text to it: remove them if it needs them)" if own else ""))
    elif exhausted:
        g.exhausted = True
    elif stuck:
        g.error = f"{g.kind} cannot continue: it allows only raw control characters or surrogates here"
    return not (exhausted or stuck)


def _stop_bits(masks: torch.Tensor, states: list[GrammarState], eos_ids: list[int]) -> torch.Tensor:
    """The bits of each row's own stop tokens that its grammar allows now (packed like masks). EOS
    ids need none: the vocabulary table allows them already; most rows cost nothing."""
    stops = torch.zeros_like(masks)
    for j, g in enumerate(states):
        for t in set(g.stop_ids).difference(eos_ids):
            if t >> 5 < masks.shape[1]:
                stops[j, t >> 5] |= masks[j, t >> 5] & _bit(t & 31)
    return stops


def _bit(k: int) -> int:
    """Bit k of a packed int32 word as an int32 value (bit 31 is the sign bit)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
