"""Orcinus engine: iteration-level scheduling and selective batching over a paged KV cache."""

from engine.config import EngineConfig, ModelShape
from engine.llm import LLM, Completion
from engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "Completion", "EngineConfig", "InvalidRequestError", "ModelShape", "SamplingParams"]
