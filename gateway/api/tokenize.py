"""POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's shapes: the server's own tokenizer for
clients that count tokens (the same ids the engine gets, chat template included)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from engine.core.sampling_params import InvalidRequestError
from gateway.api.detokenizer import token_text
from gateway.api.protocol import ChatMessage, TokenId, decode_request
from gateway.api.serving import ServerState, json_response, read_body


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=False):
    """A `prompt` (completions' tokenization) or `messages` (the chat template's), not both."""

    model: str | None = None
    prompt: Annotated[str, Meta(max_length=4 * 1024 * 1024)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's header, as a chat request does
    add_special_tokens: bool | None = None  # prompt: BOS where the tokenizer asks for it (default true)
    return_token_strs: bool = False

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send either `prompt` or `messages`", "prompt")


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=False):
    model: str | None = None
    tokens: Annotated[list[TokenId], Meta(max_length=1024 * 1024)]

    def validate(self) -> None:
        pass


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


def _tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", "model")
    return state.tokenizer


async def tokenize(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), TokenizeRequest)
    state.check_model(req.model)
    tok = _tokenizer(state)
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        ids = await state.encode_chat(
            lambda: tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt),
            [m["content"] for m in messages],
        )
    else:
        if req.add_special_tokens is False:
            ids = tok.encode(req.prompt)
        else:
            [ids] = await state.encode_prompts([req.prompt])
    strs = [token_text(tok, i) for i in ids] if req.return_token_strs else None
    return json_response(
        TokenizeResponse(count=len(ids), max_model_len=state.engine_limits().max_model_len, tokens=ids, token_strs=strs)
    )


async def detokenize(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), DetokenizeRequest)
    state.check_model(req.model)
    tok = _tokenizer(state)
    bad = next((i for i in req.tokens if not 0 <= i < tok.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0 to {tok.vocab_size - 1})", "tokens")
    return json_response(DetokenizeResponse(prompt=tok.decode(req.tokens)))


async def tokenizer_info(request: Request, state: ServerState) -> Response:
    tok = _tokenizer(state)
    info: dict[str, Any] = {
        "tokenizer_class": type(tok).__name__,
        "vocab_size": tok.vocab_size,
        "model_max_length": state.engine_limits().max_model_len,
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    }
    return Response(msgspec.json.encode(info), media_type="application/json")
