"""Did every run of a sweep produce the same tokens? (batch invariance: a sweep should change the timing only.)

Each run's generations.parquet is read as {(id, sample_index): output_token_ids}; every run is compared
with the first, and the first difference (in the first run's row order) is named: the request, the
sample, the output position and the two tokens there. A request missing from a run is a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

GENERATIONS = "generations.parquet"

Key = tuple[str, int]


@dataclass(slots=True)
class TokenDiff:
    """Where a run's tokens first part from the reference run's."""

    run: str
    key: Key
    position: int | None  # output position of the first differing token; None: missing from one run
    reference: int | None  # the reference run's token there (None: its output ended, or it lacks the request)
    got: int | None

    def describe(self, reference_run: str) -> str:
        rid, sample = self.key
        who = f"request `{rid}` sample {sample}"
        if self.position is None:
            where = "missing from" if self.got is None else "only in"
            return f"{who} is {where} `{self.run}` (reference `{reference_run}`)"
        return (f"{who} differs at output position {self.position}: `{reference_run}` has "
                f"{_tok(self.reference)}, `{self.run}` has {_tok(self.got)}")


def _tok(t: int | None) -> str:
    return "no token (output ended)" if t is None else f"token {t}"


def read_tokens(run_dir: Path) -> dict[Key, list[int]] | None:
    """A run's output tokens by (id, sample_index); None when it has no generations file."""
    path = Path(run_dir) / GENERATIONS
    if not path.exists():
        return None
    names = pq.read_schema(path).names
    cols = ["id", "output_token_ids"] + (["sample_index"] if "sample_index" in names else [])
    t = pq.read_table(path, columns=cols).to_pydict()
    samples = t.get("sample_index") or [0] * len(t["id"])
    # A resumed run may hold a request twice (an errored try, then its retry): the last row wins.
    return {(str(i), int(s or 0)): list(toks or []) for i, s, toks in zip(t["id"], samples, t["output_token_ids"])}


def first_difference(run: str, ref: dict[Key, list[int]], got: dict[Key, list[int]]) -> TokenDiff | None:
    for key, want in ref.items():
        have = got.get(key)
        if have is None:
            return TokenDiff(run, key, None, None, None)
        for pos in range(max(len(want), len(have))):
            a = want[pos] if pos < len(want) else None
            b = have[pos] if pos < len(have) else None
            if a != b:
                return TokenDiff(run, key, pos, a, b)
    extra = next((k for k in got if k not in ref), None)
    return None if extra is None else TokenDiff(run, extra, None, None, -1)


def compare_runs(sweep_dir: Path, runs: list[str]) -> dict[str, TokenDiff | None | str]:
    """Per run (relative directory): None (same tokens as the first run with tokens), its first
    TokenDiff, or "no generations" when it wrote no generations.parquet."""
    out: dict[str, TokenDiff | None | str] = {}
    ref: dict[Key, list[int]] | None = None
    for run in runs:
        tokens = read_tokens(Path(sweep_dir) / run)
        if tokens is None:
            out[run] = "no generations"
        elif ref is None:
            ref, out[run] = tokens, None
        else:
            out[run] = first_difference(run, ref, tokens)
    return out


def tokens_line(rows: list[dict]) -> str | None:
    """One line for sweep.md from the rows' same_tokens / first_token_diff: identical tokens across
    the runs, or how many runs differ and the first difference. None with fewer than two runs to compare."""
    compared = [r for r in rows if r.get("same_tokens") is not None]
    if len(compared) < 2:
        return None
    differ = [r for r in compared if not r["same_tokens"]]
    if not differ:
        return f"- Tokens: identical in all {len(compared)} runs for every request"
    return (f"- Tokens: {len(differ)} of {len(compared) - 1} runs differ from `{compared[0]['run']}`; the first: "
            f"{differ[0]['first_token_diff']}")
