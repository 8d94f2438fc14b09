"""Prefix-cache keys cannot collide, and a refused admission leaves the prefix cache untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

from ladle.engine import SamplingParams
from ladle.engine.kv_cache import hash_block
from tests.engine.helpers import make_engine, random_prompt, run_to_completion


def test_keys_are_sha256_over_parent_tokens_and_extra_keys():
    k1 = hash_block(None, [1, 2, 3])
    assert isinstance(k1, bytes) and len(k1) == 32
    assert hash_block(None, [1, 2, 3]) == k1  # deterministic
    assert hash_block(k1, [4]) != hash_block(None, [4])  # the prefix is part of the key
    assert hash_block(None, [1, 2, 3], ("lora:a",)) != k1  # so is anything else that shapes the KV
    assert hash_block(None, [1, 2, 3], ("lora:a",)) != hash_block(None, [1, 2, 3], ("lora:b",))
    # Length-prefixed: extra keys cannot be re-split to forge another input's encoding.
    assert hash_block(None, [1], ("ab", "c")) != hash_block(None, [1], ("a", "bc"))
    manual = hashlib.sha256(hashlib.sha256(b"ladle/prefix-cache/v1").digest())
    manual.update((3).to_bytes(4, "little") + array("q", [1, 2, 3]).tobytes())
    assert manual.digest() == k1


def test_a_collision_of_the_old_builtin_hash_is_two_keys_now():
    """Python's int hash is reduced modulo 2**61 - 1, so (parent, tokens) tuples that differ by that
    modulus hashed equal: the chained builtin hash could hand one prefix another's KV."""
    a, b = (5,), (5 + (2**61 - 1),)
    assert hash((None, a)) == hash((None, b))  # the old key function collided here
    assert hash_block(None, a) != hash_block(None, b)


def test_keys_are_the_same_in_every_process():
    code = "from ladle.engine.kv_cache import hash_block; print(hash_block(None, [7, 8, 9]).hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_block(None, [7, 8, 9]).hex()


def _chain(tokens: list[int], block_size: int) -> list[bytes]:
    keys, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


def test_refused_admission_does_not_evict_cached_blocks(tiny_hf_model_dir):
    """C is refused by max_partial_prefills=1 while B is mid-prefill. Admitting C would have needed
    two of A's cached blocks; being refused, it must leave them (and the whole pool) as they were."""
    eng = make_engine(tiny_hf_model_dir("qwen3"), num_blocks=12, size=16, max_partial_prefills=1,
                      prefix_caching=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    a_prompt = random_prompt(64, seed=1)
    eng.generate([a_prompt], one)  # A's 4 full blocks are cached and unreferenced
    pool = eng.kv.pool
    a_keys = _chain(a_prompt, 16)
    a_blocks = [pool.lookup(k) for k in a_keys]
    assert None not in a_blocks

    eng.add_request(random_prompt(100, seed=2), one, request_id="B")
    eng.step()  # B admitted, mid-prefill: it took the 7 never-cached blocks
    assert eng.requests["B"].num_computed_tokens == 16
    eng.add_request(random_prompt(40, seed=3), one, request_id="C")
    before = (list(pool._free), dict(pool._cached), list(pool.ref_counts), pool.num_evictions)
    eng.step()
    assert eng.requests["C"] in eng.scheduler.waiting  # refused
    after = (list(pool._free), dict(pool._cached), list(pool.ref_counts), pool.num_evictions)
    b_new = {k for k in after[1] if k not in before[1]}  # B's second block got published this step
    assert {k: v for k, v in after[1].items() if k not in b_new} == before[1]
    assert after[0] == before[0] and after[2] == before[2] and after[3] == before[3]
    assert [pool.lookup(k) for k in a_keys] == a_blocks
    run_to_completion(eng)
    pool.check_invariants()
