"""GET /openapi.json: the HTTP contract, generated from the msgspec structs the server decodes and encodes.

Every documented response is one the server can send: the JSON bodies are the same Structs the
routes encode, streams are `text/event-stream` (each `data:` line a chunk Struct, an ErrorResponse,
or `[DONE]`), and every error status carries OpenAI's error shape.
"""

from __future__ import annotations

from importlib import metadata

import msgspec

from gateway.api.embeddings import EmbeddingRequest, EmbeddingResponse
from gateway.api.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from gateway.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from gateway.api.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    OutputItemEvent,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    TextDeltaEvent,
    TextDoneEvent,
)
from gateway.api.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gateway.web.errors import ErrorResponse

_REF = "#/components/schemas/{name}"
_EVENTS = (
    ResponseEvent,
    OutputItemEvent,
    ContentPartEvent,
    TextDeltaEvent,
    TextDoneEvent,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
)
_STRUCTS = (
    CompletionRequest,
    CompletionResponse,
    CompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionChunk,
    ModelList,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ResponsesRequest,
    ResponseObject,
    *_EVENTS,
)
# A Responses stream's failure: an `error` event.
# Which error statuses each kind of route can answer, and why.
_ERRORS = {
    400: "Invalid request: the body, a field, or a prompt longer than the context window.",
    401: "Missing or wrong API key (only when the server has one).",
    404: "Unknown model.",
    408: "The request body took too long to arrive.",
    413: "Request body over the size limit.",
    415: "The body is not sent as `Content-Type: application/json`.",
    429: "The server is at capacity; retry after `Retry-After` seconds.",
    503: "The engine is not available (starting, restarting, or stopped).",
}
_GENERATE_ERRORS = (400, 404, 408, 413, 415, 429, 503)  # and 401 with an API key
# Request examples: documentation, and the first cases a fuzzer sends (each response kind once).
_COMPLETION_EXAMPLES = {
    "text": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "stream": {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "logprobs": {"prompt": "1, 2, 3,", "max_tokens": 4, "logprobs": 2, "n": 2, "seed": 7},
}
_CHAT_EXAMPLES = {
    "text": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0},
    "stream": {
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "logprobs": {
        "messages": [{"role": "user", "content": "Count to three."}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    },
}
_RESPONSES_EXAMPLES = {
    "text": {"input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0},
    "stream": {"input": [{"role": "user", "content": "Name a color."}], "max_output_tokens": 6, "stream": True},
}
_LORA_EXAMPLES = {
    "load": {"lora_name": "sql", "lora_path": "/path/to/adapter"},
    "unload": {"lora_name": "sql"},
}
_RETRY_AFTER = {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 0}}


def _ref(cls: type) -> dict:
    return {"$ref": _REF.format(name=cls.__name__)}


def _error(status: int) -> dict:
    response = {"description": _ERRORS[status], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    if status in (429, 503):  # always on 429; on 503 when a retry is likely to work soon
        response["headers"] = {"Retry-After": {**_RETRY_AFTER, "required": status == 429}}
    return response


def _generate(summary: str, request: type, response: type, chunk: type | None, examples: dict, secured: bool) -> dict:
    # OpenAPI 3.1 has an event stream's `schema` describe one event; its `data` is JSON or the final `[DONE]`.
    if chunk is not None:
        json_data = {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
        }
        stream = {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}, "event": {"const": "message"}},
            }
        }
        described = (
            f"The whole {response.__name__} (JSON), or with `stream: true` a stream of "
            f"`data: <{chunk.__name__}>` events ending in `data: [DONE]`; a failure after the stream started "
            "is one `data: <ErrorResponse>` event before `[DONE]`."
        )
    else:  # the Responses API: typed events, each under an `event:` line of its type, no [DONE]
        events = {"anyOf": list(map(_ref, _EVENTS))}
        stream = {
            "schema": {
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "event": {"type": "string"},
                    "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": events},
                },
            }
        }
        described = (
            f"The whole {response.__name__} (JSON), or with `stream: true` its typed events (`event: <type>`"
            ", `data: <event>`), from response.created to response.completed or response.incomplete; a "
            "failure after the stream started is an `error` event, then response.failed."
        )
    op = {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _ref(request),
                    "examples": {name: {"value": value} for name, value in examples.items()},
                }
            },
        },
        "responses": {
            "200": {
                "description": described,
                "content": {"application/json": {"schema": _ref(response)}, "text/event-stream": stream},
            },
            **{str(s): _error(s) for s in sorted({*_GENERATE_ERRORS, *((401,) if secured else ())})},
        },
    }
    if secured:
        op["security"] = [{"bearer": []}]
    return {"post": op}


def _lora_routes(api_key: bool) -> dict:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only where LoRA is on); plain-text successes."""

    def op(summary: str, request: type, example: str, done: str, errors: dict) -> dict:
        body = {"schema": _ref(request), "examples": {example: {"value": _LORA_EXAMPLES[example]}}}
        text = {"text/plain": {"schema": {"type": "string"}, "example": done}}
        statuses = {str(st): why for st, why in errors.items()}
        statuses |= {str(st): _error(st) for st in (408, 413, 415, *((401,) if api_key else ()))}
        operation = {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": body}},
            "responses": {"200": {"description": done, "content": text}, **dict(sorted(statuses.items()))},
        }
        if api_key:
            operation["security"] = [{"bearer": []}]
        return {"post": operation}

    def error(description: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}

    load = op(
        "Serve a LoRA adapter (a PEFT directory) under a model name",
        LoadLoraAdapterRequest,
        "load",
        "Success: LoRA adapter 'sql' added successfully.",
        {
            400: error("A field is missing, the name is taken, or the files are not an adapter this model takes."),
            503: _error(503),
        },
    )
    unload = op(
        "Stop serving a LoRA adapter (requests running under it finish)",
        UnloadLoraAdapterRequest,
        "unload",
        "Success: LoRA adapter 'sql' removed successfully.",
        {
            400: error("`lora_name` is missing, or the engine could not unload the adapter."),
            404: error("No adapter of that name is loaded."),
        },
    )
    return {"/v1/load_lora_adapter": load, "/v1/unload_lora_adapter": unload}


def openapi_document(api_key: bool, metrics_need_key: bool, lora: bool = False) -> dict:
    """The OpenAPI 3.1 document (JSON Schema 2020-12, which msgspec emits); `lora`: with the adapter routes."""
    structs = (*_STRUCTS, LoadLoraAdapterRequest, UnloadLoraAdapterRequest) if lora else _STRUCTS
    _, schemas = msgspec.json.schema_components(structs, ref_template=_REF)
    unauthorized = {"401": _error(401)} if api_key else {}
    models = {
        "summary": "The served model",
        "responses": {
            "200": {"description": "One model.", "content": {"application/json": {"schema": _ref(ModelList)}}},
            **unauthorized,
        },
    }
    model = {
        "summary": "One model by its id",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {
            "200": {"description": "The model.", "content": {"application/json": {"schema": _ref(ModelCard)}}},
            "404": _error(404),
            **unauthorized,
        },
    }
    tokenize, detokenize, embeddings = (
        {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {"description": summary, "content": {"application/json": {"schema": _ref(response)}}},
                **{str(s): _error(s) for s in (400, 404, 408, 413, 415, 503)},
                **unauthorized,
            },
        }
        for summary, request, response in (
            ("Token ids of a prompt or chat messages", TokenizeRequest, TokenizeResponse),
            ("The text of token ids", DetokenizeRequest, DetokenizeResponse),
            ("Embeddings of texts or token ids (pooled final hidden states)", EmbeddingRequest, EmbeddingResponse),
        )
    )
    embeddings["responses"]["429"] = _error(429)  # admitted like a generation
    info = {
        "summary": "The tokenizer's configuration (vLLM's /tokenizer_info)",
        "responses": {
            "200": {
                "description": "Tokenizer class, special tokens, chat template, context length.",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            "503": _error(503),
            **unauthorized,
        },
    }
    metrics = {
        "summary": "Prometheus metrics",
        "responses": {
            "200": {
                "description": "Prometheus text format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **(unauthorized if metrics_need_key else {}),
        },
    }
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    kept = {
        "get": {
            "summary": "A kept response (`store`), by its id",
            "parameters": response_id,
            "responses": {
                "200": {
                    "description": "The response.",
                    "content": {"application/json": {"schema": _ref(ResponseObject)}},
                },
                "404": _error(404),
                **unauthorized,
            },
        },
        "delete": {
            "summary": "Forget a kept response",
            "parameters": response_id,
            "responses": {
                "200": {
                    "description": "Deleted.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["id", "object", "deleted"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"const": "response.deleted"},
                                    "deleted": {"const": True},
                                },
                            }
                        }
                    },
                },
                "404": _error(404),
                **unauthorized,
            },
        },
    }
    health = {
        "summary": "Liveness of the engine",
        "responses": {
            "200": {
                "description": "The engine is ready.",
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}
                    }
                },
            },
            "503": _error(503),
        },
    }
    if api_key:
        for op in (models, model, tokenize, detokenize, embeddings, info, kept["get"], kept["delete"]):
            op["security"] = [{"bearer": []}]
        if metrics_need_key:
            metrics["security"] = [{"bearer": []}]
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "Orcinus",
            "version": _version(),
            "description": "OpenAI-compatible completions served by an Orca-style engine.",
        },
        "paths": {
            "/v1/completions": _generate(
                "Text completion", CompletionRequest, CompletionResponse, CompletionChunk, _COMPLETION_EXAMPLES, api_key
            ),
            "/v1/chat/completions": _generate(
                "Chat completion",
                ChatCompletionRequest,
                ChatCompletionResponse,
                ChatCompletionChunk,
                _CHAT_EXAMPLES,
                api_key,
            ),
            "/v1/responses": _generate(
                "Response (the Responses API)", ResponsesRequest, ResponseObject, None, _RESPONSES_EXAMPLES, api_key
            ),
            "/v1/responses/{response_id}": kept,
            "/v1/embeddings": {"post": embeddings},
            "/v1/models": {"get": models},
            "/v1/models/{model}": {"get": model},
            "/tokenize": {"post": tokenize},
            "/detokenize": {"post": detokenize},
            "/tokenizer_info": {"get": info},
            "/health": {"get": health},
            "/metrics": {"get": metrics},
            **(_lora_routes(api_key) if lora else {}),
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _version() -> str:
    try:
        return metadata.version("orcinus")
    except metadata.PackageNotFoundError:
        return "0.0.0"
