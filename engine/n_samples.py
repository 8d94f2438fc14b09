"""n samples per prompt: the prompt is prefilled once, then forked into n samples sharing its KV.

A request with params.n = k > 1 is a parent: it is scheduled like any request until its last prefill
chunk is computed. That step's logits row (the last prompt position) is repeated k times, one row per
sample, so each sample draws its first token from the same distribution with its own random stream.
The parent then forks (LLMEngine._fork): sample 0 takes over the parent's blocks, every other sample
shares the parent's full blocks (a reference each, engine/block_pool.py) and gets a copy of the partly
filled last block (KVCacheManager.fork). A sample with no room for its copy, or beyond max_num_seqs,
waits like a preempted request, holding its first token: it is recomputed (prompt + that token) when
admitted, cheaply with prefix caching. From then on the samples are independent requests with the same
request_id and their own sample_index; the parent is only the handle abort_request finds.
"""

from __future__ import annotations

import hashlib

import torch

from engine.request import Request, RequestStatus


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 uses the seed itself (so it
    equals the n=1 output with that seed), the others a 63-bit digest of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"ladle/sample/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_samples(parent: Request, device: torch.device) -> list[Request]:
    """The parent's n samples, before any KV is assigned (they take the parent's place on fork)."""
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
        )
        if p.seed is not None:
            child.generator = torch.Generator(device=device).manual_seed(sample_seed(p.seed, i))
        samples.append(child)
    return samples


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
