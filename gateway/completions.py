"""POST /v1/completions."""

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
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, decode_request,
)
from gateway.serving import ServerState, json_response, read_body, until_done_or_disconnect


async def create_completion(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), CompletionRequest)
    state.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs is not supported (no prompt logprobs)", "echo")
    limits = state.engine_limits()
    grammar = await state.grammar(req)
    prompts = await state.encode_prompts(req.prompts)
    params = req.to_sampling_params(default_max_tokens=limits.max_model_len - max(len(p) for p in prompts),
                                    grammar=grammar)
    for ids in prompts:
        state.check_prompt(ids, params)
    # A text prompt echoes as sent (not with the BOS the tokenizer put first); token ids as their text.
    echo = [(text if isinstance(text, str) else state.tokenizer.decode(ids)) if req.echo and state.tokenizer else ""
            for text, ids in zip(req.prompts, prompts)]
    salt = state.cache_salt(request, req.cache_salt)
    gen = state.generation(prompts, params, req.n, req.stop_strings, salt)  # admitted from here: close() it
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    top_n = req.logprobs

    def choice(event: ChoiceEvent, text_before: int) -> CompletionChoice:
        prompt_echo = echo[event.index // req.n]
        prefix = prompt_echo if text_before == 0 else ""
        logprobs = None
        if top_n is not None:
            logprobs = _logprobs(state, event, top_n, len(prompt_echo))
        return CompletionChoice(index=event.index, text=prefix + event.text, logprobs=logprobs,
                                finish_reason=event.finish_reason)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks():
            emitted: dict[int, int] = {}
            async for event in gen.events():
                before = emitted.get(event.index, 0)
                c = choice(event, before)
                emitted[event.index] = before + len(c.text)
                yield CompletionChunk(id=rid, created=created, model=state.model_name, choices=[c],
                                      usage=None if include_usage else msgspec.UNSET)
            if include_usage:
                yield CompletionChunk(id=rid, created=created, model=state.model_name, choices=[],
                                      usage=Usage.of(gen.num_prompt_tokens, gen.num_completion_tokens))

        return state.sse(chunks(), on_close=gen.close)

    async def collect() -> Response:
        merged: dict[int, CompletionChoice] = {}
        async for event in gen.events():
            prev = merged.get(event.index)
            c = choice(event, len(prev.text) if prev else 0)
            if prev is None:
                merged[event.index] = c
                continue
            prev.text += c.text
            prev.finish_reason = c.finish_reason
            if prev.logprobs is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(prev.logprobs, name).extend(getattr(c.logprobs, name))
        return json_response(CompletionResponse(
            id=rid, created=created, model=state.model_name, choices=[merged[i] for i in sorted(merged)],
            usage=Usage.of(gen.num_prompt_tokens, gen.num_completion_tokens),
        ))

    try:
        return await until_done_or_disconnect(request, collect())
    finally:
        gen.close()


def _logprobs(state: ServerState, event: ChoiceEvent, top_n: int, base_offset: int) -> CompletionLogprobs:
    tok = state.tokenizer
    text = (lambda i: token_text(tok, i)) if tok is not None else str
    return CompletionLogprobs(
        tokens=[text(t) for t, _, _ in event.logprobs],
        token_logprobs=[lp for _, lp, _ in event.logprobs],
        top_logprobs=[{text(i): v for i, v in top[:top_n]} for _, _, top in event.logprobs],
        text_offset=[base_offset + o for o in event.token_offsets],
    )
