"""ladle.kernels.cpu_paged.zeros_on_huge_pages: the KV cache's memory goes back to the OS when the cache dies,
and the tensor is an ordinary one to save, copy and share."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ladle.kernels.cpu_paged import zeros_on_huge_pages

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="no /proc: RSS not readable")
def test_a_dead_cache_is_returned_to_the_os():
    """Caches of 6 MiB a layer, made and dropped six times, in a fresh process (glibc's heap state is
    the point): the resident memory comes back down. On malloc's heap (glibc serves such sizes there once
    its dynamic mmap threshold rose), with the huge-page advice, all 24 MiB stayed resident."""
    code = textwrap.dedent("""
        import gc, torch
        from ladle.kernels.cpu_paged import zeros_on_huge_pages
        def rss_mib():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        zeros_on_huge_pages((1,), torch.float32)
        base = rss_mib()
        for _ in range(6):
            caches = [zeros_on_huge_pages((2, 192, 16, 4, 64), torch.float32) for _ in range(4)]
            held = rss_mib() - base
            del caches
            gc.collect()
        print(held, rss_mib() - base)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=True)
    held, after = (float(v) for v in run.stdout.split())
    assert held >= 20, held  # the caches were resident (a positive control for the RSS reading)
    assert after < 6, (held, after)


def test_the_tensor_owns_exactly_its_bytes():
    """Saved, pickled, cloned or moved to shared memory it is the zeros it promised, and its storage is
    its own bytes (no alignment slack saved along with it)."""
    shape = (2, 40, 16, 2, 64)
    t = zeros_on_huge_pages(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()
    assert t.untyped_storage().nbytes() == t.numel() * 2
    t[1, 3] = 1.5
    buffer = io.BytesIO()
    torch.save(t, buffer)
    assert len(buffer.getvalue()) < t.numel() * 2 + 4096
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), t) and torch.equal(t.clone(), t)
    assert torch.equal(t.clone().share_memory_(), t)
    assert zeros_on_huge_pages((0, 16), torch.float32).shape == (0, 16)
    assert not zeros_on_huge_pages((3, 2 << 20), torch.int8).any()
