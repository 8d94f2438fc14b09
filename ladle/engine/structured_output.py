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

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ladle.engine.grammar_vocab import VocabMasks, VocabularyError, tokenizer_info
from ladle.engine.json_schema_support import json_schema_problem
from ladle.engine.request import Request
from ladle.engine.sampling_params import StructuredOutputs

CACHE_SIZE = 256  # compiled specs kept (one grammar's token-mask cache can be megabytes)
_INSTALL_HINT = "structured output needs xgrammar: pip install 'ladle[structured]'"


def spec_of(so: StructuredOutputs) -> tuple[str, Any]:
    """(kind, value) of the one field set (SamplingParams.problems() has checked there is exactly one)."""
    for kind in ("json_schema", "regex", "choice", "grammar"):
        value = getattr(so, kind)
        if value is not None:
            return kind, value
    raise ValueError("StructuredOutputs has no field set")


def cache_key(so: StructuredOutputs) -> str:
    """The spec as canonical JSON: equal specs (a schema as dict or as text, any key order) share a compile."""
    kind, value = spec_of(so)
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # not JSON: compiling it reports the error; key on the raw text
    return json.dumps([kind, value], sort_keys=True, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF alternation of the literal strings. JSON string quoting is also xgrammar's EBNF literal
    syntax (backslash, quote, control characters escaped; other characters, unicode included, as is)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _compile_error(kind: str, exc: BaseException) -> str:
    """'json_schema is not valid: <the compiler's reason>' without the C++ file/line prefix."""
    if isinstance(exc, VocabularyError):
        return f"structured output is not available for this model's tokenizer: {exc}"
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    text = text.splitlines()[0] if text else type(exc).__name__
    return f"{kind} is not valid: {text}"


def schema_text(schema: Any) -> str:
    """A json_schema as the text the compiler reads: as it is when text, else its JSON (a dict's int keys
    become strings, tuples lists). The one rule for the compile, the config check and the request's own
    copy of its params (engine/input_processor.own_copy), so all three judge the same schema. Raises
    TypeError / ValueError / RecursionError for a value JSON cannot write."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def spec_error(so: StructuredOutputs) -> str | None:
    """Why the spec cannot compile, found by parsing it without a tokenizer (cheap: no model needed, so
    a config-wide spec is checked before the model loads); None when it parses."""
    try:
        import xgrammar as xgr
    except ImportError:
        return _INSTALL_HINT
    kind, value = spec_of(so)
    if kind == "json_schema":
        try:
            value = schema_text(value)
        except (TypeError, ValueError, RecursionError) as exc:
            return f"json_schema cannot be written as JSON ({type(exc).__name__}: {exc}); give it as JSON text"
    if kind == "json_schema" and (problem := json_schema_problem(value)):
        return problem
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(value, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        else:
            xgr.Grammar.from_ebnf(choice_grammar(list(value)) if kind == "choice" else value)
    except Exception as exc:  # noqa: BLE001 - the parser's message is the answer
        return _compile_error(kind, exc)
    return None


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
                self.error = _compile_error(self.kind, exc)
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
            return _INSTALL_HINT
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
        keep = []
        for j, (i, g, ex, st) in enumerate(zip(rows, states, exhausted.tolist(), stuck.tolist())):
            g.may_end = None
            if not ex and not st and not g.stop_ids and g.matcher.is_completed():
                g.may_end = masks[j].clone()  # complete, could go on: the model decides (see verdict)
            elif ex and g.stop_ids:
                # A complete grammar allows its stop tokens, so an empty mask means it is stuck short of
                # complete: a token it needs is one of the request's own stop_token_ids (those are taken
                # out of the grammar's vocabulary), or no token can continue it at all.
                own = g.own_stop_ids
                g.error = (f"{g.kind} cannot continue: no token of the vocabulary continues it here"
                           + (f" (its stop_token_ids {own} are not text to it: remove them if it needs them)"
                              if own else ""))
            elif ex:
                g.exhausted = True
            elif st:
                g.error = f"{g.kind} cannot continue: it allows only raw control characters or surrogates here"
            else:
                keep.append(i)
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
