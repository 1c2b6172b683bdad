"""The Starlette app: OpenAI routes, health, metrics, the OpenAPI document, the chat page, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from engine.core.lora_pool import parse_lora
from engine.model.tokenizer.chat_template import load_chat_template
from gateway.api.chat import create_chat_completion
from gateway.api.completions import create_completion
from gateway.api.embeddings import create_embedding
from gateway.api.lora import load_lora_adapter, unload_lora_adapter
from gateway.api.openapi import openapi_document
from gateway.api.protocol import AdapterCard, ModelCard, ModelList
from gateway.api.responses import create_response, delete_response, retrieve_response
from gateway.api.serving import ServerState, finished_before, json_response
from gateway.api.special_tokens import ContentTokens
from gateway.api.structured import SchemaCompiler
from gateway.api.tokenize import detokenize, tokenize, tokenizer_info
from gateway.banner import startup_block
from gateway.config import GatewayConfig, make_replicas
from gateway.engines.replicas import Replicas
from gateway.web import errors
from gateway.web.auth import APIKeyMiddleware, CacheSalts
from gateway.web.cors import add_cors
from gateway.web.guards import TrustedHostMiddleware, page_headers
from gateway.web.in_flight import InFlightLimit

CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


def served_name(config: GatewayConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    model = config.engine.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model if model.startswith("dummy:") else model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def load_gateway_tokenizer(model: str | None):
    """The tokenizer alone (no weights): the gateway tokenizes and detokenizes, the engine computes."""
    from engine.model.model_files import ModelNotFoundError, default_model_path
    from engine.model.tokenizer import load_tokenizer

    if model is not None and not model.startswith("dummy:"):
        return load_tokenizer(model)
    try:
        return load_tokenizer(default_model_path())
    except ModelNotFoundError:
        if model is None:
            raise
        return None


def build_app(config: GatewayConfig, client: Replicas | None = None) -> Starlette:
    """The app; `client`: the config's replicas made (and perhaps launched) already, else made here."""
    client = client or make_replicas(config)
    metrics = client.metrics
    in_flight = InFlightLimit(
        config.engine.max_num_seqs * config.data_parallel_size, config.max_waiting, metrics, config.max_queued_tokens
    )
    tokenizer = load_gateway_tokenizer(config.engine.model)
    if tokenizer is not None and config.chat_template is not None:
        tokenizer.chat_template = load_chat_template(config.chat_template)
    content_tokens = None if tokenizer is None else ContentTokens(tokenizer, config.special_tokens_in_content)
    state = ServerState(
        client,
        tokenizer,
        metrics,
        served_name(config),
        in_flight,
        CacheSalts(config.prefix_cache_scope),
        SchemaCompiler(),
        content_tokens,
        config.shutdown_timeout,
        config.pooling,
    )
    state.adapters.update(parse_lora(spec) for spec in config.engine.lora)
    if state.model_name in state.adapters:  # a request naming it would get the base model, never the adapter
        raise ValueError(f"--lora {state.model_name}=...: an adapter may not take the served model's name")
    for name in (state.model_name, *state.adapters):
        metrics.add_model(name)
    started = int(time.time())
    keyed = bool(config.api_keys)
    metrics_need_key = keyed and config.metrics_need_key
    contract = msgspec.json.encode(openapi_document(keyed, metrics_need_key, config.engine.lora_enabled))
    page = CHAT_PAGE.read_text(encoding="utf-8")
    page_security = page_headers(page)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        start = asyncio.ensure_future(state.client.start(config.engine_start_timeout))
        if not await finished_before(start, state.stopping.wait()):
            # Ctrl-C or SIGTERM during a load that may take minutes: end it now (uvicorn then listens only to stop).
            await asyncio.gather(start, return_exceptions=True)
            await state.client.stop()
            state.grammars.close()
            logging.getLogger("uvicorn.error").info("stopped while the engine was loading")
            yield
            return
        start.result()  # a model that cannot load at all: its error, here
        # What start-up made (the tokenizer's tables, modules, the app) lives as long as the server: out of the
        # collector's sight, a full collection scans only what serving makes: under many open connections a full
        # collection of it all stalls every stream and /health (vLLM freezes it too).
        gc.collect()
        gc.freeze()
        # uvicorn's own logger: the block sits with its "Uvicorn running on ..." lines.
        logging.getLogger("uvicorn.error").info(
            "%s",
            startup_block(
                state.client.ready, state.model_name, config.url, keyed, config.data_parallel_size, state.client.routing
            ),
        )
        try:
            yield
        finally:
            await state.client.stop()
            state.grammars.close()

    def handler(route):
        """A route handler that takes the server's state (completions, chat, tokenize...), bound to it."""

        async def run(request: Request) -> Response:
            return await route(request, state)

        return run

    def card(name: str) -> ModelCard:
        if name in state.adapters:
            return AdapterCard(id=name, created=started, parent=state.model_name)
        return ModelCard(id=state.model_name, created=started)

    async def models(request: Request) -> Response:
        return json_response(ModelList(data=[card(state.model_name), *map(card, state.adapters)]))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        state.check_model(name)
        return json_response(card(name))

    async def health(request: Request) -> Response:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        return errors.error_response(errors.service_unavailable("The engine is not available."))

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def openapi(request: Request) -> Response:
        return Response(contract, media_type="application/json")

    async def chat_page(request: Request) -> Response:
        return HTMLResponse(page, headers=page_security)

    # Only where adapters are served: a server without them keeps its routes (and its OpenAPI document) as they were.
    lora_routes = (
        [
            Route("/v1/load_lora_adapter", handler(load_lora_adapter), methods=["POST"]),
            Route("/v1/unload_lora_adapter", handler(unload_lora_adapter), methods=["POST"]),
        ]
        if config.engine.lora_enabled
        else []
    )
    app = Starlette(
        routes=[
            Route("/v1/completions", handler(create_completion), methods=["POST"]),
            Route("/v1/chat/completions", handler(create_chat_completion), methods=["POST"]),
            Route("/v1/embeddings", handler(create_embedding), methods=["POST"]),
            Route("/v1/responses", handler(create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", handler(retrieve_response), methods=["GET"]),
            Route("/v1/responses/{response_id}", handler(delete_response), methods=["DELETE"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/tokenize", handler(tokenize), methods=["POST"]),
            Route("/detokenize", handler(detokenize), methods=["POST"]),
            Route("/tokenizer_info", handler(tokenizer_info), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/", chat_page, methods=["GET"]),
            *lora_routes,
        ],
        exception_handlers=errors.EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.orcinus = state
    if keyed:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys, protect_metrics=metrics_need_key)
    add_cors(app, config.allowed_origins)
    if config.allowed_hosts is not None:  # last: the outermost layer, before CORS answers a rebound page
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=config.allowed_hosts)
    return app
