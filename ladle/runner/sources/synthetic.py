"""Synthetic random-token prompts: seeded groups with lognormal prompt and output lengths."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ladle.runner.arrivals import arrival_times
from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.sources.base import Source, limit_total
from ladle.runner.sources.rows import Row, batched
from ladle.runner.sources.shard import Shard


class SyntheticSource(Source):
    """Random token-id prompts, seeded, from one or more groups (lognormal prompt and output lengths).

    Ids are "<group>-<k>". A group with its own `arrival` gives each row an arrival time (seconds; 0
    for groups without one), read by `workload.arrivals.process=trace`; rows are ordered by that time.
    Token ids are drawn per row from a generator seeded by (seed, group, k), so only arrival times are
    held in memory.
    """

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        super().__init__(workload, None, shard)  # synthetic rows carry their own arrival
        s = workload.synthetic
        self.num_rows = limit_total(sum(g.num_requests for g in s.groups), workload.limit)
        self.description = "synthetic " + ", ".join(f"{g.name} x{g.num_requests}" for g in s.groups)

    def group_prompt_lengths(self, gi: int) -> list[int]:
        """The prompt lengths of group gi's rows (the same draws as read() makes)."""
        s, g = self.workload.synthetic, self.workload.synthetic.groups[gi]
        return [g.shared_prefix_len + self._lengths(np.random.default_rng([s.seed, gi, k]), g.prompt_len,
                                                    g.prompt_len_sigma, g.min_prompt_len, g.max_prompt_len)
                for k in range(g.num_requests)]

    def _plan(self) -> list[tuple[float, int, int]]:
        """(arrival, group index, k) of every row, in arrival order. Drawn when reading starts, so a
        group whose arrivals have a `load` gets its rate from the calibration the job made."""
        plan = []
        for gi, g in enumerate(self.workload.synthetic.groups):
            if g.arrival is None:
                times = np.zeros(g.num_requests)
            else:
                rate = None
                if g.arrival.load is not None:
                    if self.calibration is None:
                        raise ConfigError(f"workload.synthetic group {g.name!r}: arrival.load needs a calibration")
                    lengths = self.group_prompt_lengths(gi)
                    rate = self.calibration.rate(g.arrival.load, sum(lengths) / max(len(lengths), 1))
                    self.rates[g.name] = rate
                times = arrival_times(g.arrival, g.num_requests, rate)
            plan += [(float(t), gi, k) for k, t in enumerate(times)]
        plan.sort()
        return plan if self.workload.limit is None else plan[: self.workload.limit]

    def _lengths(self, rng: np.random.Generator, median: int, sigma: float, lo: int, hi: int | None) -> int:
        n = median * float(np.exp(rng.normal(0.0, sigma))) if sigma > 0 else median
        n = max(lo, round(n))
        return min(n, hi) if hi is not None else n

    def read(self) -> Iterator[list[Row]]:
        s = self.workload.synthetic
        vocab = s.vocab_size or self.vocab_size
        if vocab is None or vocab <= s.min_token_id:
            raise ConfigError(f"workload.synthetic: vocabulary size {vocab} must exceed "
                              f"min_token_id={s.min_token_id}")
        return batched(self._rows(vocab), self.workload.batch_size)

    def _rows(self, vocab: int) -> Iterator[Row]:
        s = self.workload.synthetic
        prefixes = []
        for gi, g in enumerate(s.groups):
            rng = np.random.default_rng([s.seed, gi, 1 << 30])
            prefixes.append(rng.integers(s.min_token_id, vocab, size=g.shared_prefix_len).tolist())
        for index, (t, gi, k) in enumerate(self._plan()):
            g = s.groups[gi]
            rng = np.random.default_rng([s.seed, gi, k])
            n = self._lengths(rng, g.prompt_len, g.prompt_len_sigma, g.min_prompt_len, g.max_prompt_len)
            ids = prefixes[gi] + rng.integers(s.min_token_id, vocab, size=n).tolist()
            mt = (self._lengths(rng, g.max_tokens, g.max_tokens_sigma, 1, None) if g.max_tokens is not None else None)
            yield Row(index=index, id=f"{g.name}-{k}", prompt=ids, max_tokens=mt, arrival=t, klass=g.name)
