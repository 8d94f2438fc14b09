"""The engine's greedy outputs with the Triton kernels equal those with the torch reference.

On this CPU-only machine the Triton kernels run through the interpreter (TRITON_INTERPRET=1, which
must be set before triton is first imported, hence a subprocess). On a CUDA machine the same script
runs the compiled kernels when the tensors are on the GPU.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import triton_subprocess_env

# Not importorskip: importing triton here would fix it in compiled mode for this whole process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import sys
    from ladle.engine import SamplingParams
    from tests.engine.helpers import make_engine, random_prompt

    path, backend = sys.argv[1], sys.argv[2]
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # Two engines in one process, each with its own attention backend (model.attention_backend).
    ref_engine = make_engine(path, backend=backend, size=8, attention_backend="torch")
    tri_engine = make_engine(path, backend=backend, size=8, attention_backend="triton")
    ref = ref_engine.generate(prompts, params)
    tri = tri_engine.generate(prompts, params)
    assert ref_engine.generate(prompts, params)[0].output_token_ids == ref[0].output_token_ids
    for r, t in zip(ref, tri):
        assert r.output_token_ids == t.output_token_ids, (r.output_token_ids, t.output_token_ids)
    print("identical", [len(t.output_token_ids) for t in tri])
    """
)


@pytest.mark.parametrize("family,backend", [("gemma3", "paged"), ("qwen3", "contiguous")])
def test_engine_greedy_with_triton_equals_reference(tiny_hf_model_dir, family, backend):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_hf_model_dir(family)), backend],
        env=triton_subprocess_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical [6, 6, 6]" in proc.stdout
