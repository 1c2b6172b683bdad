"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.core.request import TokenLogprobs
from gateway.api.detokenizer import IncrementalDetokenizer, token_text
from gateway.api.generation import ChoiceEvent
from gateway.api.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    Usage,
    decode_request,
)
from gateway.api.serving import ServerState, json_response, read_body, until_done_or_disconnect


async def create_completion(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), CompletionRequest)
    lora = state.check_model(req.model)
    served = lora or state.model_name  # the name responses carry: the adapter's, as the request named it
    limits = state.engine_limits()
    grammar = await state.grammar(req)
    prompts = await state.encode_prompts(req.prompts)
    # A prompt that leaves no room still asks for a token: check_prompt then names the context window (as chat's).
    room = max(limits.max_model_len - max(len(p) for p in prompts), 1)
    params = req.to_sampling_params(default_max_tokens=room, grammar=grammar)
    for ids in prompts:
        state.check_prompt(ids, params)
    # A text prompt echoes as sent (not with the BOS the tokenizer put first); token ids as their text.
    echo = [
        (text if isinstance(text, str) else state.tokenizer.decode(ids)) if req.echo and state.tokenizer else ""
        for text, ids in zip(req.prompts, prompts)
    ]
    options = req.to_request_options(state.cache_salt(request, req.cache_salt), lora)
    gen = state.generation(prompts, params, req.n, req.stop_strings, options)  # admitted from here: close() it
    gen.prompt_only = req.prompt_only
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    top_n = req.logprobs

    def choice(event: ChoiceEvent, text_before: int) -> CompletionChoice:
        p = event.index // req.n
        prompt_echo = echo[p]
        prefix = prompt_echo if text_before == 0 else ""
        logprobs = None
        if top_n is not None:
            logprobs = _logprobs(state, event, top_n, len(prompt_echo))
            if req.echo and event.prompt_logprobs is not None:
                echoed = _echoed_logprobs(state, req.prompts[p], prompt_echo, prompts[p], event.prompt_logprobs, top_n)
                logprobs = _join(echoed, logprobs)
        c = CompletionChoice(
            index=event.index, text=prefix + event.text, logprobs=logprobs, finish_reason=event.finish_reason
        )
        if req.prompt_logprobs is not None and event.prompt_logprobs is not None:
            c.prompt_logprobs = _vllm_prompt_logprobs(state, event.prompt_logprobs, req.prompt_logprobs)
        return c

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks():
            emitted: dict[int, int] = {}
            async for event in gen.events():
                before = emitted.get(event.index, 0)
                c = choice(event, before)
                emitted[event.index] = before + len(c.text)
                yield CompletionChunk(
                    id=rid,
                    created=created,
                    model=served,
                    choices=[c],
                    usage=None if include_usage else msgspec.UNSET,
                )
            if include_usage:
                yield CompletionChunk(
                    id=rid, created=created, model=served, choices=[], usage=Usage.of(*gen.token_counts)
                )

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
                _join(prev.logprobs, c.logprobs)
        return json_response(
            CompletionResponse(
                id=rid,
                created=created,
                model=served,
                choices=[merged[i] for i in sorted(merged)],
                usage=Usage.of(*gen.token_counts),
            )
        )

    try:
        return await until_done_or_disconnect(request, collect())
    finally:
        gen.close()


def _logprobs(state: ServerState, event: ChoiceEvent, top_n: int, base_offset: int) -> CompletionLogprobs:
    tok = state.tokenizer
    text = (lambda i: token_text(tok, i)) if tok is not None else str
    return CompletionLogprobs(
        tokens=[text(x.token_id) for x in event.logprobs],
        token_logprobs=[x.logprob for x in event.logprobs],
        top_logprobs=[{text(i): v for i, v in x.top[:top_n]} for x in event.logprobs],
        text_offset=[base_offset + o for o in event.token_offsets],
    )


def _join(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """`then`'s tokens appended to `first`'s (in place); returns `first`."""
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(first, name).extend(getattr(then, name))
    return first


def _echoed_logprobs(
    state: ServerState, sent: str | list[int], echo: str, ids: list[int], rows: list[TokenLogprobs], top_n: int
) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: its first token's logprob and alternatives null (nothing
    predicts it), each token's text as the echo shows it and its offset there."""
    tok = state.tokenizer
    text = (lambda i: token_text(tok, i)) if tok is not None else str
    tokens, offsets = _echoed_tokens(tok, sent, echo, ids)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None, *(row.logprob for row in rows)],
        top_logprobs=[None, *({text(i): v for i, v in row.top[:top_n]} for row in rows)],
        text_offset=offsets,
    )


def _echoed_tokens(tok, sent: str | list[int], echo: str, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each prompt token's text as `echo` (the text as sent, or the ids' decoded text) shows it, and its offset there:
    the slice from it to the next token's offset (a BOS added before a text prompt is listed at 0)."""
    if tok is None:
        return [str(i) for i in ids], [0] * len(ids)
    added = (
        isinstance(sent, str)
        and tok.add_bos_token
        and ids[:1] == [tok.bos_token_id]
        and not sent.startswith(tok.bos_token)
    )
    body = ids[1:] if added else ids
    detok = IncrementalDetokenizer(tok, (), skip_special_tokens=False)
    detok.push(body)
    decoded = detok.text + detok.flush()
    starts = detok.token_offsets
    spaced = echo.replace("\u2581", " ")  # SentencePiece reads a sent "▁" as the space it spells
    tokens, offsets, pos = [token_text(tok, tok.bos_token_id)] * added, [0] * added, 0
    for i, start, end in zip(body, starts, [*starts[1:], len(decoded)]):
        piece, shown = decoded[start:end].replace("\u2581", " "), token_text(tok, i)
        # The space SentencePiece puts before a text (and llama.cpp before each stretch after a special token) is in
        # no echo: not in the text as sent, and decode() drops it at the start.
        if not spaced.startswith(piece, pos) and piece.startswith(" ") and spaced.startswith(piece[1:], pos):
            piece = piece[1:]
        if spaced.startswith(piece, pos) and not shown.startswith("bytes:"):
            shown = echo[pos : pos + len(piece)]
        tokens.append(shown)
        offsets.append(min(pos, len(echo)))
        pos += len(piece)
    return tokens, offsets


def _vllm_prompt_logprobs(
    state: ServerState, rows: list[TokenLogprobs], top_n: int
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: null, then per prompt token its own entry and the top `top_n` alternatives."""
    tok = state.tokenizer
    text = (lambda i: token_text(tok, i)) if tok is not None else str
    out: list[dict[int, PromptLogprob] | None] = [None]
    for row in rows:
        entry = {row.token_id: PromptLogprob(logprob=row.logprob, rank=row.rank, decoded_token=text(row.token_id))}
        for k, (i, v) in enumerate(row.top[:top_n]):
            entry.setdefault(i, PromptLogprob(logprob=v, rank=k + 1, decoded_token=text(i)))
        out.append(entry)
    return out
