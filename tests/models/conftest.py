"""Dynamo counts recompiles per code object across the whole process: every model compiled in a test
adds one (CausalLM._forward guards on its instance), so after ~8 compiled models in one pytest run a
later fullgraph compile fails on the recompile limit. Each test starts from a clean dynamo cache."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()
