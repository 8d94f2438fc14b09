"""The engine's greedy outputs with the Triton kernels equal those with the torch reference.

On this CPU-only machine the Triton kernels run through the interpreter (TRITON_INTERPRET=1, which
must be set before triton is first imported, hence a subprocess). On a CUDA machine the same script
runs the compiled kernels when the tensors are on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import sys
    import kernels
    from engine import SamplingParams
    from tests.engine.helpers import make_engine, random_prompt

    path, backend = sys.argv[1], sys.argv[2]
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kernels.set_backend("torch")
    ref = make_engine(path, backend=backend, size=8).generate(prompts, params)
    kernels.set_backend("triton")
    tri = make_engine(path, backend=backend, size=8).generate(prompts, params)
    for r, t in zip(ref, tri):
        assert r.output_token_ids == t.output_token_ids, (r.output_token_ids, t.output_token_ids)
    print("identical", [len(t.output_token_ids) for t in tri])
    """
)


@pytest.mark.parametrize("family,backend", [("gemma3", "paged"), ("qwen3", "contiguous")])
def test_engine_greedy_with_triton_equals_reference(tiny_hf_model_dir, family, backend):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_hf_model_dir(family)), backend],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical [6, 6, 6]" in proc.stdout
