"""Dynamo counts recompiles per code object across the whole process: models of one architecture and
dtype share a graph (test_compile.test_models_past_the_recompile_limit_share_one_graph), but every other
architecture, dtype or family the tests compile adds one entry to CausalLM._forward's cache, and past
the recompile limit a fullgraph compile fails. Each test starts from a clean dynamo cache."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()
