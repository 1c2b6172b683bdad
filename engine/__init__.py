"""Orcinus engine: iteration-level scheduling and selective batching over a paged KV cache."""

from engine.core.config import EngineConfig, ModelShape
from engine.core.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "Completion", "EngineConfig", "InvalidRequestError", "ModelShape", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that the gateway process (which needs only configs and messages) never imports torch.
    if name in ("LLM", "Completion"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
