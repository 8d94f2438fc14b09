"""Serving core: requests, scheduler, KV cache, model runner, sampler and the LLMEngine."""

from engine.clock import Clock, VirtualClock, WallClock
from engine.config import CacheConfig, ChunkingConfig, EngineConfig, EngineConfigError, ModelConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestMetrics, RequestOutput, StepStats
from engine.sampling_params import SamplingParams

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
