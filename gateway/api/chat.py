"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.core.sampling_params import InvalidRequestError
from gateway.api.detokenizer import token_text
from gateway.api.generation import ChoiceEvent, Generation
from gateway.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ToolCallChunk,
    TopLogprob,
    Usage,
    decode_request,
)
from gateway.api.serving import ServerState, json_response, read_body, until_done_or_disconnect
from gateway.api.tool_stream import ToolCallStream
from gateway.api.tools import ToolPlan


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its generation (close() it) and how to read what it generates."""

    gen: Generation
    plan: ToolPlan
    parallel: bool  # several tool calls may come
    top_n: int | None  # top logprobs per token, None without logprobs
    model: str  # the name responses carry: the base model's, or the adapter's the request named


async def start_chat(req: ChatCompletionRequest, request: Request, state: ServerState) -> ChatRun:
    """Render, encode and admit a decoded chat request (the Responses API runs as one too)."""
    lora = state.check_model(req.model)
    if state.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer or chat template", "messages")
    grammar = await state.grammar(req)  # first: the tools' schemas are checked (depth included) before rendering
    plan = req.tool_plan()
    tok = state.tokenizer
    if plan.active and tok.renders_tools:
        messages, tools = req.template_messages(), plan.template_tools()
    else:
        messages, tools = req.template_messages(plan), None
    prompt = await state.encode_chat(
        lambda: tok.apply_chat_template(messages, tools=tools), [m["content"] for m in messages]
    )
    limits = state.engine_limits()
    params = req.to_sampling_params(default_max_tokens=max(limits.max_model_len - len(prompt), 1), grammar=grammar)
    state.check_prompt(prompt, params, "messages")
    options = req.to_request_options(state.cache_salt(request, req.cache_salt), lora)
    gen = state.generation([prompt], params, req.n, req.stop_strings, options)
    # OpenAI's default: several calls may come
    return ChatRun(gen, plan, req.parallel_tool_calls is not False, params.logprobs, lora or state.model_name)


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), ChatCompletionRequest)
    run = await start_chat(req, request, state)  # admitted from here: close() its generation
    gen, plan, parallel, top_n = run.gen, run.plan, run.parallel, run.top_n
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(event: ChoiceEvent) -> ChatLogprobs | None:
        if top_n is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **_top(state, x.token_id, x.logprob),
                    top_logprobs=[TopLogprob(**_top(state, i, v)) for i, v in x.top[:top_n]],
                )
                for x in event.logprobs
            ]
        )

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = None if include_usage else msgspec.UNSET

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=run.model, choices=choices, usage=usage)

        async def chunks():
            # OpenAI opens every choice with a role-only delta.
            for i in range(req.n):
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            streams = {i: ToolCallStream(plan, parallel) for i in range(req.n)} if plan.active else {}
            held: dict[int, list] = {i: [] for i in streams}  # logprobs of events that sent nothing yet
            async for event in gen.events():
                calls: list[ToolCallChunk] = []
                text, finish = event.text, event.finish_reason
                if event.index in streams:
                    stream = streams[event.index]
                    text, calls = stream.feed(event.text)
                    if finish:
                        rest, more, made_calls = stream.finish(finish == "stop")
                        text, calls = text + rest, calls + more
                        finish = "tool_calls" if made_calls and finish == "stop" else finish
                    if not (text or calls or finish):
                        held[event.index] += event.logprobs
                        continue
                    event.logprobs, held[event.index] = held[event.index] + event.logprobs, []
                delta = ChatDelta(content=text or None, tool_calls=calls or None)
                if text or calls or event.logprobs or finish:
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=event.index, delta=delta, logprobs=logprobs(event), finish_reason=finish
                            )
                        ]
                    )
            if include_usage:
                yield ChatCompletionChunk(
                    id=rid, created=created, model=run.model, choices=[], usage=Usage.of(*gen.token_counts)
                )

        return state.sse(chunks(), on_close=gen.close)

    async def collect() -> Response:
        texts: dict[int, list[str]] = {}
        content: dict[int, list[ChatTokenLogprob]] = {}
        finish: dict[int, str] = {}
        async for event in gen.events():
            texts.setdefault(event.index, []).append(event.text)
            if (lp := logprobs(event)) is not None:
                content.setdefault(event.index, []).extend(lp.content)
            if event.finish_reason:
                finish[event.index] = event.finish_reason
        choices = []
        for i in sorted(texts):
            text, reason = "".join(texts[i]), finish.get(i)
            calls = plan.parse_calls(text, parallel) if reason == "stop" else []
            message = (
                ChatResponseMessage(content=None, tool_calls=calls) if calls else ChatResponseMessage(content=text)
            )
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason="tool_calls" if calls else reason,
                    logprobs=ChatLogprobs(content=content.get(i, [])) if top_n is not None else None,
                )
            )
        return json_response(
            ChatCompletionResponse(
                id=rid,
                created=created,
                model=run.model,
                choices=choices,
                usage=Usage.of(*gen.token_counts),
            )
        )

    try:
        return await until_done_or_disconnect(request, collect())
    finally:
        gen.close()


def _top(state: ServerState, token_id: int, logprob: float) -> dict:
    text = token_text(state.tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(state.tokenizer.token_bytes(token_id))}
