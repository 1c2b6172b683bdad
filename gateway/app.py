"""The Starlette app: OpenAI routes, health, metrics, API-key check, and the engine process's lifetime."""

from __future__ import annotations

import contextlib
import hmac
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.config import EngineConfig
from gateway import errors
from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.engine_client import EngineClient
from gateway.metrics import Metrics
from gateway.protocol import ModelCard, ModelList
from gateway.serving import ServerState, json_response


@dataclass(frozen=True)
class GatewayConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # what the engine process runs
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer <key>`
    served_model_name: str | None = None  # the `model` clients send; None = derived from the model path
    engine_start_timeout: float = 300.0  # seconds to wait for the model to load


def served_name(config: GatewayConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    model = config.engine.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model if model.startswith("dummy:") else model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def load_gateway_tokenizer(model: str | None):
    """The tokenizer alone (no weights): the gateway tokenizes and detokenizes, the engine computes."""
    from pathlib import Path

    from engine.model_files import ModelNotFoundError, default_model_path
    from engine.tokenizer import Tokenizer

    if model is not None and Path(model).is_dir():
        return Tokenizer.from_hf_dir(model) if (Path(model) / "tokenizer.json").is_file() else None
    if model is not None and not model.startswith("dummy:"):
        return Tokenizer.from_file(model)
    try:
        return Tokenizer.from_file(default_model_path())
    except ModelNotFoundError:
        if model is None:
            raise
        return None


class APIKeyMiddleware:
    """Pure ASGI (streams pass through untouched); constant-time comparison."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await errors.error_response(errors.authentication_error())(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(config: GatewayConfig) -> Starlette:
    metrics = Metrics()
    state = ServerState(EngineClient(config.engine, metrics), load_gateway_tokenizer(config.engine.model),
                        metrics, served_name(config))
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.client.start(config.engine_start_timeout)
        try:
            yield
        finally:
            await state.client.stop()

    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    async def chat(request: Request) -> Response:
        return await create_chat_completion(request, state)

    async def models(request: Request) -> Response:
        return json_response(ModelList(data=[ModelCard(id=state.model_name, created=started)]))

    async def health(request: Request) -> Response:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        return errors.error_response(errors.service_unavailable("The engine is not available."))

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        exception_handlers=errors.EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.orcinus = state
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app
