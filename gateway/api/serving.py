"""What every OpenAI endpoint shares: the server's state, body limits, prompt checks, SSE and disconnects."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import jinja2
import msgspec
from sse_starlette import EventSourceResponse
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engine.core.request import NO_OPTIONS, RequestOptions
from engine.core.request_limits import RequestLimits
from engine.core.sampling_params import InvalidRequestError, SamplingParams
from engine.model.tokenizer.chat_template import SHIPPED, NoChatTemplateError
from gateway.api.generation import Generation
from gateway.api.protocol import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_DRAIN_BYTES
from gateway.api.response_store import ResponseStore
from gateway.api.special_tokens import ContentTokens
from gateway.api.structured import SchemaCompiler
from gateway.engines.client import EngineUnavailableError
from gateway.engines.replicas import Replicas
from gateway.web import errors
from gateway.web.auth import TENANT, CacheSalts
from gateway.web.guards import is_json
from gateway.web.in_flight import InFlightLimit
from gateway.web.metrics import Metrics

log = logging.getLogger("orcinus.gateway")
_json = msgspec.json.Encoder()
NO_CHAT_TEMPLATE = (
    "the model has no chat template, and none shipped fits its architecture: pass --chat-template "
    f"FILE_OR_NAME (names: {', '.join(SHIPPED)}) to orcinus serve"
)
THREADED_ENCODE_CHARS = 1 << 14  # a request with more text is tokenized off the event loop (tokenizers free the GIL)


@dataclass
class ServerState:
    client: Replicas
    tokenizer: object | None  # None for dummy models without the default tokenizer: token-id prompts only
    metrics: Metrics
    model_name: str
    in_flight: InFlightLimit
    salts: CacheSalts
    grammars: SchemaCompiler
    content_tokens: ContentTokens | None  # how chat messages' special-token text is tokenized; None: no tokenizer
    drain_timeout: float = 30.0  # seconds a stream may go on after SIGTERM before it is cut
    pooling: str = "last"  # how /v1/embeddings pools a prompt's hidden states (GatewayConfig.pooling)
    live: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # generations in flight
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's kept responses
    loop: asyncio.AbstractEventLoop | None = None  # the server's, set at startup
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # SIGINT or SIGTERM came: also ends a load
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served as model names -> their paths
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # adapter loads and unloads, one at a time

    def begin_shutdown(self) -> None:
        """SIGTERM (any thread): shortly before the drain timeout, end what is still in flight with an error
        event and [DONE] (a 503 for a whole response) rather than a cut connection; their requests are aborted."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
            at = max(self.drain_timeout - min(1.0, self.drain_timeout / 4), 0.0)
            self.loop.call_soon_threadsafe(self.loop.call_later, at, self._end_in_flight)

    def _end_in_flight(self) -> None:
        error = errors.service_unavailable("The server is shutting down; the request was stopped.")
        for gen in list(self.live):
            gen.fail(error)

    def check_model(self, model: str | None) -> str:
        """The LoRA adapter a request's `model` names ("" for the base model); a 404 for a name not served."""
        if model is None or model == self.model_name:
            return ""
        if model in self.adapters:
            return model
        raise errors.model_not_found(model)

    def engine_limits(self) -> RequestLimits:
        ready = self.client.ready
        if ready is None or not self.client.healthy:
            raise errors.service_unavailable("The engine is not available; retry shortly.", retry_after=1)
        return ready.limits

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Completions prompts as token ids: text tokenized with BOS first where the tokenizer asks for it
        (add_special_tokens), ids as they are."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompts as token ids", "prompt")
        return await _off_loop(
            lambda: [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=True) for p in prompts],
            sum(map(len, texts)),
        )

    async def encode_chat(self, render: Callable[[], str], contents: list[str]) -> list[int]:
        """The chat prompt `render()` makes, as token ids (only what the template writes); `contents` are its
        messages' contents, for escaping."""

        def work() -> list[int]:
            try:
                prompt = render()
            except jinja2.TemplateError as e:  # a template's raise_exception(): it refuses these messages
                raise InvalidRequestError(f"the model's chat template refused the messages: {e}", "messages") from None
            except NoChatTemplateError:
                raise InvalidRequestError(NO_CHAT_TEMPLATE, "messages") from None
            return self.content_tokens.encode(prompt, contents)

        return await _off_loop(work, sum(map(len, contents)))

    async def grammar(self, req) -> str | None:
        """The request's output grammar (None: unconstrained), compiled in the pool with every other schema it names
        (each must compile); the request waits, the event loop does not."""
        output = req.output_schema()
        jobs = [self.grammars.grammar(schema, param) for schema, param in req.checked_schemas()]
        if output is not None:
            jobs.append(self.grammars.grammar(*output))
        grammars = await asyncio.gather(*jobs)
        return grammars[-1] if output is not None else None

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        """Reject here what the engine would reject (the same check), so a bad request never reaches it."""
        self.engine_limits().check(ids, params, param)

    def cache_salt(self, request: Request, cache_salt: str | None) -> bytes:
        """The prefix-cache salt of a request: from its API key (by the scope) and its `cache_salt` field."""
        return self.salts.salt(request.scope.get("state", {}).get(TENANT), cache_salt)

    def generation(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        stop: list[str],
        options: RequestOptions = NO_OPTIONS,
    ) -> Generation:
        """Admit the request's sequences (429 past the queue's bound); the caller must `close()` the Generation."""
        ticket = self.in_flight.reserve(len(prompts) * n, n * sum(map(len, prompts)))
        self.metrics.requests.labels(options.lora or self.model_name).inc()
        gen = Generation(self.client, self.metrics, self.tokenizer, prompts, params, n, stop, ticket, options)
        self.live.add(gen)
        return gen

    def sse(self, events: AsyncIterator[object], on_close: Callable[[], None], named: bool = False) -> Response:
        return sse(events, on_close, self.drain_timeout, named)


async def _off_loop(work: Callable[[], list], chars: int) -> list:
    """`work()` here, or in a thread when the request's text is long: a huge prompt must not stall other streams."""
    if chars > THREADED_ENCODE_CHARS:
        return await asyncio.to_thread(work)
    return work()


async def read_body(request: Request) -> bytes:
    """The request body; not JSON a 415, past MAX_BODY_BYTES a 413, after draining what the client is still sending."""
    if not is_json(request.headers.get("content-type")):
        await _drain(request, 0)
        raise errors.unsupported_media_type()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        await _drain(request, 0)
        raise errors.request_too_large(MAX_BODY_BYTES)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT):  # a body trickled in byte by byte holds the handler no longer
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    await _drain(request, len(body))
                    raise errors.request_too_large(MAX_BODY_BYTES)
    except ClientDisconnect:
        raise errors.invalid_request("the client disconnected while sending the body") from None
    except TimeoutError:
        raise errors.request_timeout(BODY_TIMEOUT) from None
    return bytes(body)


async def _drain(request: Request, already: int) -> None:
    """Read and drop the rest of a refused body, up to MAX_DRAIN_BYTES, as nginx does: a client that writes its
    whole body before reading (urllib, curl without Expect) would otherwise have the connection reset under it
    and never see the 413. Past the bound the connection is closed anyway."""
    seen = already
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_DRAIN_BYTES:
                return
    except ClientDisconnect:
        return


class _ClosingEventSource(EventSourceResponse):
    """Calls `on_close` when the response is over, however it ends: a generator that never started
    (the client left first) runs no `finally` of its own."""

    def __init__(self, *args, on_close: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(
    events: AsyncIterator[object], on_close: Callable[[], None], drain_timeout: float, named: bool = False
) -> Response:
    """Stream msgspec structs as `data:` events, then `data: [DONE]`; an error mid-stream is an error event.
    `named` (the Responses API): each under an `event:` line of its `type`, an error as an `error` event, no [DONE].
    On server shutdown a stream may go on for `drain_timeout` seconds (sse-starlette would cut it at once)."""

    async def gen():
        try:
            async for event in events:
                data = _json.encode(event).decode()
                yield {"event": event.type, "data": data} if named else {"data": data}
        except Exception as e:
            # A bug must not cut the stream: the client gets the 500 a whole response would get, in the stream.
            if isinstance(e, (EngineUnavailableError, InvalidRequestError, errors.APIError)):
                api = as_api_error(e)
            else:
                log.exception("unhandled error in a stream", exc_info=e)
                api = errors.internal_error()
            if named:
                yield {
                    "event": "error",
                    "data": _json.encode(
                        {"type": "error", "code": api.code, "message": api.message, "param": api.param}
                    ).decode(),
                }
                return
            yield {"data": errors.error_body(api).decode()}
        if not named:
            yield {"data": "[DONE]"}

    return _ClosingEventSource(gen(), ping=15, shutdown_grace_period=drain_timeout, on_close=on_close)


async def finished_before(task: asyncio.Future, other: Awaitable) -> bool:
    """Await `task` unless `other` completes first, which cancels `task`; whether `task` finished."""
    watcher = asyncio.ensure_future(other)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True
    task.cancel()
    return False


async def until_done_or_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    if not await finished_before(task, disconnected()):
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    try:
        return task.result()
    except (EngineUnavailableError, InvalidRequestError) as e:
        raise as_api_error(e) from None


def as_api_error(e: Exception) -> errors.APIError:
    if isinstance(e, errors.APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return errors.from_invalid_request(e)
    return errors.service_unavailable(str(e), retry_after=1)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")
