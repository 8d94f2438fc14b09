"""Serving core: requests, scheduler, KV cache, model runner, sampler and the LLMEngine."""

from ladle.engine.clock import Clock, VirtualClock, WallClock
from ladle.engine.config import CacheConfig, ChunkingConfig, EngineConfig, EngineConfigError, ModelConfig
from ladle.engine.llm_engine import LLMEngine
from ladle.engine.request import RequestMetrics, RequestOutput, StepStats
from ladle.engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "ChunkingConfig",
    "Clock",
    "EngineConfig",
    "EngineConfigError",
    "LLMEngine",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
    "VirtualClock",
    "WallClock",
]
