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
    engine: EngineConfig = field(default_factory=EngineConfig)  # what the engine process runs
    data_parallel_size: int = 1  # engine replicas, each its own process(es), KV cache and scheduler
    routing: RoutingPolicy = "cache-aware"  # which replica serves a request (with several)
    api_keys: tuple[str, ...] = ()  # when any, every /v1 route needs `Authorization: Bearer <one of them>`
    served_model_name: str | None = None  # the `model` clients send; None = derived from the model path
    engine_start_timeout: float = 300.0  # seconds to wait for the model to load
    max_waiting: int | None = None  # sequences queued beyond the engine's batch; None: admission's default (4096)
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS  # prompt tokens admitted at once (each choice counts its own)
    metrics_need_key: bool = True  # with API keys, /metrics needs one too (its prefix-cache counters tell of prompts)
    # with API keys: each key's cached prefixes, and the recent outputs its drafts come from, its own; or all shared
    prefix_cache_scope: Literal["key", "global"] = "key"
    special_tokens_in_content: Literal["allow", "escape"] = "allow"  # chat content's "<|im_start|>": special, or text
    chat_template: str | None = None  # a Jinja file or a shipped template's name, over the model's own template
    shutdown_timeout: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    engine_hang_timeout: float = 60.0  # an engine silent this long is killed and restarted
    engine_unresponsive_timeout: float = 3.0  # an engine process without a heartbeat this long is out of routing
    allowed_origins: tuple[str, ...] | None = None  # CORS origins; None = http://localhost:* and http://127.0.0.1:*
    allowed_hosts: tuple[str, ...] | None = None  # Host header values answered ("*.example.com", "*"); None = any
    url: str | None = None  # where clients reach the server, for the startup log (None: not logged)


def make_replicas(config: GatewayConfig) -> Replicas:
    """A server's replicas, with metrics of their own (raises ValueError for a combination they cannot run)."""
    return Replicas(config.engine, Metrics(), config.engine_hang_timeout, config.data_parallel_size, config.routing,
                    config.engine_unresponsive_timeout)
