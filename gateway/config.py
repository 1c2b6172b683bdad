"""The server's settings beyond the engine's: one frozen dataclass, light to import (the CLI builds it before it
starts the engines, and those before it imports the app)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.core.config import EngineConfig
from gateway.engines.replicas import Replicas
from gateway.engines.routing import RoutingPolicy
from gateway.web.in_flight import DEFAULT_MAX_QUEUED_TOKENS
from gateway.web.metrics import Metrics


@dataclass(frozen=True)
class GatewayConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """What the engine process runs."""
    data_parallel_size: int = 1
    """Engine replicas behind this gateway, each with its own process(es), KV cache and scheduler (and, on GPUs, its
    own tensor x pipeline devices)."""
    routing: RoutingPolicy = "cache-aware"
    """Which replica serves a request: the one holding the longest cached prefix of its prompt, balanced against load,
    the one with the fewest tokens in flight, or in turn."""
    api_keys: tuple[str, ...] = ()
    """When any, every /v1 route needs `Authorization: Bearer <one of them>`."""
    served_model_name: str | None = None
    """The model name clients send; unset: derived from the model path."""
    engine_start_timeout: float = 300.0
    """Seconds to wait for the model to load."""
    max_waiting: int | None = None
    """Sequences queued beyond the engine's batch before new requests get 429; unset: 4096."""
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS
    """Prompt tokens of the admitted sequences (each choice counts its own) before new requests get 429."""
    metrics_need_key: bool = True
    """With API keys, /metrics needs one too (its prefix-cache counters tell of prompts)."""
    prefix_cache_scope: Literal["key", "global"] = "key"
    """With API keys: each key finds only its own cached prompt prefixes and drafts only from its own recent outputs
    (key), or all keys share them (global)."""
    special_tokens_in_content: Literal["allow", "escape"] = "allow"
    """Special-token text in chat messages (e.g. <|im_start|>): allow = it becomes the special token (as vLLM and
    llama.cpp), escape = it stays text."""
    chat_template: str | None = None
    """Render chat prompts with this Jinja file, or a shipped template (chatml, gemma, llama3, mistral-v1, mistral-v3,
    phi3), over the model's own; unset: the model's, else the shipped one of its architecture."""
    shutdown_timeout: float = 30.0
    """Seconds in-flight requests may take to finish after SIGTERM."""
    engine_hang_timeout: float = 60.0
    """An engine silent this long is killed and restarted."""
    engine_unresponsive_timeout: float = 3.0
    """Seconds an engine process may send not even a heartbeat before it is taken out of routing until it answers
    (its requests with no token yet go to another replica)."""
    allowed_origins: tuple[str, ...] | None = None
    """Browser origins that may call the API, e.g. https://chat.example.com, or * for any; unset: http://localhost:*
    and http://127.0.0.1:*."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values the server answers to (api.example.com, *.example.com; * for any); unset: any."""
    url: str | None = None
    """Where clients reach the server, for the startup log (None: not logged)."""
    pooling: Literal["last", "mean"] = "last"
    """How /v1/embeddings pools a prompt's final hidden states: the last token's, or the mean over its tokens (the
    embedding is then L2-normalised)."""


def make_replicas(config: GatewayConfig) -> Replicas:
    """A server's replicas, with metrics of their own (raises ValueError for a combination they cannot run)."""
    return Replicas(
        config.engine,
        Metrics(),
        config.engine_hang_timeout,
        config.data_parallel_size,
        config.routing,
        config.engine_unresponsive_timeout,
    )
