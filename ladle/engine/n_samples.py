"""n samples per prompt: the prompt is prefilled once, then forked into n samples sharing its KV.

A request with params.n = k > 1 is a parent: it is scheduled like any request until its last prefill
chunk is computed. That step's logits row (the last prompt position) is repeated k times, one row per
sample (`make_forks`, `expand_rows`), so each sample draws its first token from the same distribution
with its own random stream. The update then forks the parent (`fork`): sample 0 takes over the
parent's blocks, every other sample shares the parent's full blocks (a reference each,
engine/block_pool.py) and gets a copy of the partly filled last block (KVCacheManager.fork_blocks). A
sample with no room for its copy, or beyond max_num_seqs, waits like a preempted request, holding its
first token: it is recomputed (prompt + that token) when admitted, cheaply with prefix caching. From
then on the samples are independent requests with the same request_id and their own sample_index;
the parent is only the handle abort_request finds (`sequences`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import torch

from ladle.engine.request import Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from ladle.engine.kv_cache import KVCacheManager
    from ladle.engine.scheduler import Scheduler


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 uses the seed itself (so it
    equals the n=1 output with that seed), the others a 63-bit digest of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"ladle/sample/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def will_fork(req: Request) -> bool:
    """Whether the request's next sampling row forks it into params.n samples (a parent not yet forked)."""
    return req.params.n > 1 and req.params.max_tokens > 0 and req.parent is None and not req.children


def make_samples(parent: Request, device: torch.device) -> list[Request]:
    """The parent's n samples, before any KV is assigned (they take the parent's place on fork). Each
    gets its own matcher over the parent's compiled grammar, if it has one."""
    p = parent.params
    samples = []
    for i in range(p.n):
        child = Request(
            parent.request_id,
            parent.prompt_token_ids,
            p,
            parent.metrics,  # replaced by a copy at the fork, once the prefill's step is recorded
            index=parent.index,
            status=RequestStatus.RUNNING,
            sample_index=i,
            parent=parent,
            prompt_logprobs=parent.prompt_logprobs,  # complete after the prefill; shared, never mutated
            prompt_top_logprobs=parent.prompt_top_logprobs,
            grammar=parent.grammar.fresh() if parent.grammar is not None else None,
        )
        if p.seed is not None:
            child.generator = torch.Generator(device=device).manual_seed(sample_seed(p.seed, i))
        samples.append(child)
    return samples


def make_forks(sampling: list[Request], device: torch.device) -> dict[Request, list[Request]]:
    """Parent -> its samples, for the parents among this step's sampling requests."""
    return {r: make_samples(r, device) for r in sampling if will_fork(r)}


def expand_rows(
    items: list[Request], forks: dict[Request, list[Request]]
) -> tuple[list[int] | None, list[Request]]:
    """Logits rows and the requests that sample them: a forking parent's row once per sample (forks:
    parent -> its samples), a scoring request's row (max_tokens=0) not at all. Rows None: the rows as
    they are (the common case)."""
    rows: list[int] = []
    requests: list[Request] = []
    changed = False
    for row, req in enumerate(items):
        if req.params.max_tokens == 0:
            changed = True
        elif req in forks:
            rows.extend([row] * len(forks[req]))
            requests.extend(forks[req])
            changed = True
        else:
            rows.append(row)
            requests.append(req)
    return (rows if changed else None), requests


def fork(parent: Request, samples: list[Request], scheduler: Scheduler, kv: KVCacheManager) -> None:
    """Replace a prefilled parent by its samples. Samples without room (a free block for their copy of
    the last block, a place within max_num_seqs) wait at the front of the queue to be recomputed."""
    room = scheduler.max_num_seqs - scheduler.num_running + 1  # the parent's place is freed
    placed, deferred = [samples[0]], []
    for child in samples[1:]:
        if len(placed) < room and kv.fork_blocks(parent, child):
            placed.append(child)
        else:
            child.block_hashes = list(parent.block_hashes)
            deferred.append(child)
    kv.move_blocks(parent, samples[0])
    scheduler.replace_running(parent, placed, requeued=deferred)
    parent.children = samples
    parent.status = RequestStatus.FINISHED  # a handle now; its samples carry on
    for child in samples:
        child.metrics = dataclasses.replace(parent.metrics, token_times=[])  # the prefill's, shared history


def sequences(req: Request) -> list[Request]:
    """The sequences a request id stands for: its samples once forked, else itself."""
    return req.children or [req]


def all_finished(req: Request) -> bool:
    """Whether every sequence of the request (its parent's samples, for a sample) has finished."""
    return all(r.finished for r in sequences(req.parent or req))


def per_sample(out: RequestOutput, n: int) -> list[RequestOutput]:
    """A scoring request's one output, reported once per sample index (each "sample" scored the prompt)."""
    return [dataclasses.replace(out, sample_index=i) for i in range(n)]
