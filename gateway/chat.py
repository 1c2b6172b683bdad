"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.core.sampling_params import InvalidRequestError
from gateway.detokenizer import token_text
from gateway.generation import ChoiceEvent
from gateway.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, ToolCallChunk, TopLogprob, Usage, decode_request,
)
from gateway.tools import ToolPlan
from gateway.serving import ServerState, json_response, read_body, until_done_or_disconnect


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), ChatCompletionRequest)
    state.check_model(req.model)
    if state.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer or chat template", "messages")
    limits = state.engine_limits()
    grammar = await state.grammar(req)  # first: the tools' schemas are checked (depth included) before rendering
    plan = req.tool_plan()
    tok = state.tokenizer
    if plan.active and tok.renders_tools:
        messages, tools = req.template_messages(), plan.template_tools()
    else:
        messages, tools = req.template_messages(plan), None
    prompt = await state.encode_chat(lambda: tok.apply_chat_template(messages, tools=tools),
                                     [m["content"] for m in messages])
    params = req.to_sampling_params(default_max_tokens=max(limits.max_model_len - len(prompt), 1), grammar=grammar)
    state.check_prompt(prompt, params, "messages")
    salt = state.cache_salt(request, req.cache_salt)
    gen = state.generation([prompt], params, req.n, req.stop_strings, salt)  # admitted from here: close() it
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    top_n = params.logprobs

    def logprobs(event: ChoiceEvent) -> ChatLogprobs | None:
        if top_n is None:
            return None
        return ChatLogprobs(content=[
            ChatTokenLogprob(**_top(state, t, lp), top_logprobs=[TopLogprob(**_top(state, i, v)) for i, v in top[:top_n]])
            for t, lp, top in event.logprobs
        ])

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = None if include_usage else msgspec.UNSET

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=choices, usage=usage)

        async def chunks():
            # OpenAI opens every choice with a role-only delta.
            for i in range(req.n):
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            held = {i: HeldChoice(plan) for i in range(req.n)} if plan.active else {}
            async for event in gen.events():
                if event.index in held and held[event.index].holds(event):
                    if event.finish_reason:  # the whole answer is in: a call, or the content held back
                        yield chunk([held.pop(event.index).final_choice(event.index, logprobs)])
                    continue
                delta = ChatDelta(content=event.text) if event.text else ChatDelta()
                if event.text or event.logprobs or event.finish_reason:
                    yield chunk([ChatChunkChoice(index=event.index, delta=delta, logprobs=logprobs(event),
                                                 finish_reason=event.finish_reason)])
            if include_usage:
                yield ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=[],
                                          usage=Usage.of(*gen.token_counts))

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
            call = plan.parse(text) if reason == "stop" else None
            message = ChatResponseMessage(content=None, tool_calls=[call]) if call else ChatResponseMessage(content=text)
            choices.append(ChatChoice(index=i, message=message, finish_reason="tool_calls" if call else reason,
                                      logprobs=ChatLogprobs(content=content.get(i, [])) if top_n is not None else None))
        return json_response(ChatCompletionResponse(
            id=rid, created=created, model=state.model_name, choices=choices,
            usage=Usage.of(*gen.token_counts),
        ))

    try:
        return await until_done_or_disconnect(request, collect())
    finally:
        gen.close()


class HeldChoice:
    """A streamed choice that may be a tool call: its text is held back while it could still be one (all of it
    when a call is required; with `auto`, from a first non-blank `{`), then sent as a call or as content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text: list[str] = []
        self.events: list[ChoiceEvent] = []
        self.holding = True

    def holds(self, event: ChoiceEvent) -> bool:
        if not self.holding:
            return False
        self.text.append(event.text)
        self.events.append(event)
        start = "".join(self.text).lstrip()
        if not self.plan.forced and start and not start.startswith("{"):
            self.holding = False  # plain text: the caller sends it, starting with what was held
            event.text = "".join(self.text)
            event.logprobs = [lp for e in self.events for lp in e.logprobs]
            return False
        return True

    def final_choice(self, index: int, logprobs) -> ChatChunkChoice:
        text, last = "".join(self.text), self.events[-1]
        call = self.plan.parse(text) if last.finish_reason == "stop" else None
        merged = ChoiceEvent(index, text, [], [lp for e in self.events for lp in e.logprobs], [], last.finish_reason)
        if call is not None:
            delta = ChatDelta(tool_calls=[ToolCallChunk(index=0, id=call.id, function=call.function)])
            return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs(merged), finish_reason="tool_calls")
        return ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=logprobs(merged),
                               finish_reason=last.finish_reason)


def _top(state: ServerState, token_id: int, logprob: float) -> dict:
    text = token_text(state.tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(state.tokenizer.token_bytes(token_id))}
