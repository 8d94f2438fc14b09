"""ladle: offline LLM inference over datasets with a continuous-batching, chunked-prefill engine.

    from ladle import LLMEngine, EngineConfig, ModelConfig, CacheConfig, ChunkingConfig, SamplingParams

The subpackages are `ladle.runner` (the Hydra job), `ladle.engine` (the serving core), `ladle.models`
(the model families) and `ladle.kernels` (attention and CPU kernels); data flows in that order.

The engine's names are loaded on first use, not here: `python -m ladle` must reach its start-up step
(ladle/runner/startup.py) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["CacheConfig", "ChunkingConfig", "EngineConfig", "EngineConfigError", "LLMEngine", "ModelConfig",
           "RequestOutput", "SamplingParams", "__version__"]
_ENGINE_NAMES = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from ladle.engine import CacheConfig as CacheConfig
    from ladle.engine import ChunkingConfig as ChunkingConfig
    from ladle.engine import EngineConfig as EngineConfig
    from ladle.engine import EngineConfigError as EngineConfigError
    from ladle.engine import LLMEngine as LLMEngine
    from ladle.engine import ModelConfig as ModelConfig
    from ladle.engine import RequestOutput as RequestOutput
    from ladle.engine import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        value = getattr(importlib.import_module("ladle.engine"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ladle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_NAMES})
