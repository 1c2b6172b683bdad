"""POST /v1/embeddings in OpenAI's shape: the served decoder's final hidden states pooled over each input (the
server's --pooling), L2-normalised, optionally truncated to `dimensions` and normalised again (as OpenAI's
text-embedding-3 models do), as float lists or base64 little-endian float32."""

from __future__ import annotations

import base64
import math
import struct
from typing import Annotated, Literal

from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from engine.core.request import RequestOptions
from engine.core.sampling_params import InvalidRequestError, SamplingParams
from gateway.api.protocol import TokenId, decode_request
from gateway.api.serving import ServerState, json_response, read_body, until_done_or_disconnect

MAX_INPUTS = 2048  # inputs in one request, as OpenAI's


class EmbeddingRequest(Struct, kw_only=True, forbid_unknown_fields=False):
    input: str | list[str | TokenId | list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # keep the first this many, normalised again
    user: str | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input, a string or a list of token ids (a flat list of ids is one input)."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(i, int) for i in x):
            return [list(x)]
        return list(x)

    def validate(self) -> None:
        x = self.input
        if isinstance(x, str) or (x and all(isinstance(i, int) for i in x)):
            pass
        elif not x:
            raise InvalidRequestError("input must not be empty", "input")
        elif len({type(i) for i in x}) > 1:
            raise InvalidRequestError(
                "input must be a string, a list of strings, a list of token ids or a list of token id lists", "input"
            )
        elif len(x) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} inputs are allowed per request", "input")
        if any(len(i) == 0 for i in self.inputs):
            raise InvalidRequestError("input must not contain an empty string or list", "input")


class Embedding(Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def finish(vector: list[float], dimensions: int | None, encoding: str) -> list[float] | str:
    """Truncate to `dimensions`, L2-normalise; a float list or base64 of its little-endian float32 bytes."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise InvalidRequestError(
                f"dimensions must be at most {len(vector)}, this model's embedding size", "dimensions"
            )
        vector = vector[:dimensions]
    norm = math.sqrt(math.fsum(v * v for v in vector)) or 1.0
    packed = struct.pack(f"<{len(vector)}f", *(v / norm for v in vector))
    if encoding == "base64":
        return base64.b64encode(packed).decode("ascii")
    return list(struct.unpack(f"<{len(vector)}f", packed))  # the float32 values base64 would carry


async def create_embedding(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), EmbeddingRequest)
    if state.check_model(req.model):
        raise InvalidRequestError("embeddings come from the base model: LoRA adapters are not supported", "model")
    prompts = await state.encode_prompts(req.inputs)
    params = SamplingParams(max_tokens=1, prompt_only=True, pooling=state.pooling)
    for ids in prompts:
        state.check_prompt(ids, params, "input")
    # The API key's salt, as a completion's: an unsalted prompt would find (and time) another key's cached blocks.
    options = RequestOptions(state.cache_salt(request, None))
    gen = state.generation(prompts, params, 1, [], options)  # admitted from here: close() it
    gen.prompt_only = True

    async def collect() -> Response:
        vectors: dict[int, list[float]] = {}
        async for event in gen.events():
            if event.embedding is None:
                raise RuntimeError("the engine returned no embedding")
            vectors[event.index] = event.embedding
        data = [
            Embedding(index=i, embedding=finish(vectors[i], req.dimensions, req.encoding_format))
            for i in range(len(prompts))
        ]
        n = gen.num_prompt_tokens
        return json_response(
            EmbeddingResponse(data=data, model=state.model_name, usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n))
        )

    try:
        return await until_done_or_disconnect(request, collect())
    finally:
        gen.close()
