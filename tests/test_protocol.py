"""The OpenAI protocol structs and error shapes: decoding, validation, encoding. No model, fast."""

import asyncio
import json

import msgspec
import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request

from engine.core.request_limits import RequestLimits
from engine.core.sampling_params import InvalidRequestError, SamplingParams
from gateway.api.protocol import (
    MAX_BODY_BYTES,
    MAX_N,
    MAX_PROMPTS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    decode_request,
)
from gateway.web import errors

CMPL, CHAT = CompletionRequest, ChatCompletionRequest
MSGS = '"messages": [{"role": "user", "content": "hi"}]'


def cmpl(extra: str) -> bytes:
    return ('{"prompt": "hi"' + (", " + extra if extra else "") + "}").encode()


def chat(extra: str) -> bytes:
    return ("{" + MSGS + (", " + extra if extra else "") + "}").encode()


BAD = [
    # (id, body, kind, expected param)
    ("malformed json", b'{"prompt": ', CMPL, None),
    ("trailing garbage", b'{"prompt": "a"} x', CMPL, None),
    ("not utf-8", b"\xff\xfe", CMPL, None),
    ("body is an array", b'["hi"]', CMPL, None),
    ("body is a string", b'"hi"', CHAT, None),
    ("missing prompt", b'{"max_tokens": 3}', CMPL, "prompt"),
    ("prompt is a number", b'{"prompt": 3}', CMPL, "prompt"),
    ("max_tokens is a string", cmpl('"max_tokens": "10"'), CMPL, "max_tokens"),
    ("max_tokens is a float", cmpl('"max_tokens": 1.5'), CMPL, "max_tokens"),
    ("temperature is a string", cmpl('"temperature": "hot"'), CMPL, "temperature"),
    ("n is a bool", cmpl('"n": true'), CMPL, "n"),
    ("seed is a string", cmpl('"seed": "1"'), CMPL, "seed"),
    ("seed beyond int64", cmpl('"seed": 99999999999999999999'), CMPL, "seed"),
    ("negative max_tokens", cmpl('"max_tokens": -1'), CMPL, "max_tokens"),
    ("max_tokens 0", cmpl('"max_tokens": 0'), CMPL, "max_tokens"),
    ("temperature 5", cmpl('"temperature": 5'), CMPL, "temperature"),
    ("top_p 0", cmpl('"top_p": 0'), CMPL, "top_p"),
    ("top_k -2", cmpl('"top_k": -2'), CMPL, "top_k"),
    ("min_p 2", cmpl('"min_p": 2'), CMPL, "min_p"),
    ("presence_penalty 3", cmpl('"presence_penalty": 3'), CMPL, "presence_penalty"),
    ("repetition_penalty 0", cmpl('"repetition_penalty": 0'), CMPL, "repetition_penalty"),
    ("n 0", cmpl('"n": 0'), CMPL, "n"),
    ("n 1000", cmpl('"n": 1000'), CMPL, "n"),
    ("logprobs 21", cmpl('"logprobs": 21'), CMPL, "logprobs"),
    ("logprobs -1", cmpl('"logprobs": -1'), CMPL, "logprobs"),
    ("too many stop strings", cmpl('"stop": [' + ", ".join(f'"s{i}"' for i in range(65)) + "]"), CMPL, "stop"),
    ("stop string too long", cmpl('"stop": "' + "x" * 1000 + '"'), CMPL, "stop"),
    ("empty stop string", cmpl('"stop": [""]'), CMPL, "stop"),
    ("stop is a number", cmpl('"stop": 5'), CMPL, "stop"),
    ("logit_bias key abc", cmpl('"logit_bias": {"abc": 1}'), CMPL, "logit_bias"),
    ("logit_bias key negative", cmpl('"logit_bias": {"-1": 1}'), CMPL, "logit_bias"),
    ("logit_bias value 500", cmpl('"logit_bias": {"5": 500}'), CMPL, "logit_bias"),
    ("logit_bias value a string", cmpl('"logit_bias": {"5": "x"}'), CMPL, "logit_bias"),
    ("best_of 3", cmpl('"best_of": 3'), CMPL, "best_of"),
    ("suffix", cmpl('"suffix": "x"'), CMPL, "suffix"),
    ("empty prompt list", b'{"prompt": []}', CMPL, "prompt"),
    ("prompt of mixed types", b'{"prompt": ["a", 1]}', CMPL, "prompt"),
    ("prompt of ids and id lists", b'{"prompt": [1, [2]]}', CMPL, "prompt"),
    ("empty token list prompt", b'{"prompt": [[1], []]}', CMPL, "prompt"),
    ("negative token id", b'{"prompt": [1, -2]}', CMPL, "prompt[1]"),
    ("negative id in nested prompt", b'{"prompt": [[1], [2, -3]]}', CMPL, "prompt[1][1]"),
    ("float token id", b'{"prompt": [1, 2.5]}', CMPL, "prompt[1]"),
    ("too many prompts", json.dumps({"prompt": ["a"] * (MAX_PROMPTS + 1)}).encode(), CMPL, "prompt"),
    ("negative stop token id", cmpl('"stop_token_ids": [-1]'), CMPL, "stop_token_ids[0]"),
    ("stream not a bool", cmpl('"stream": "yes"'), CMPL, "stream"),
    ("stream_options wrong type", cmpl('"stream": true, "stream_options": "usage"'), CMPL, "stream_options"),
    (
        "include_usage wrong type",
        chat('"stream": true, "stream_options": {"include_usage": 1}'),
        CHAT,
        "stream_options.include_usage",
    ),
    ("stream_options without stream", cmpl('"stream_options": {"include_usage": true}'), CMPL, "stream_options"),
    ("min_tokens > max_tokens", cmpl('"max_tokens": 4, "min_tokens": 8'), CMPL, "min_tokens"),
    ("negative min_tokens", chat('"min_tokens": -1'), CHAT, "min_tokens"),
    ("chat: missing messages", b'{"model": "m"}', CHAT, "messages"),
    ("chat: empty messages", b'{"messages": []}', CHAT, "messages"),
    ("chat: messages not a list", b'{"messages": {"role": "user", "content": "hi"}}', CHAT, "messages"),
    (
        "chat: unknown role",
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}',
        CHAT,
        "messages[1].role",
    ),
    ("chat: missing role", b'{"messages": [{"content": "a"}]}', CHAT, "messages[0].role"),
    ("chat: content a number", b'{"messages": [{"role": "user", "content": 5}]}', CHAT, "messages[0].content"),
    ("chat: user content null", b'{"messages": [{"role": "user", "content": null}]}', CHAT, "messages[0].content"),
    (
        "chat: image part",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        CHAT,
        "messages[0].content[0].type",
    ),
    (
        "chat: text part without text",
        b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        CHAT,
        "messages[0].content[0].text",
    ),
    ("chat: top_logprobs without logprobs", chat('"top_logprobs": 2'), CHAT, "top_logprobs"),
    ("chat: top_logprobs 25", chat('"logprobs": true, "top_logprobs": 25'), CHAT, "top_logprobs"),
    ("chat: logprobs an int", chat('"logprobs": 3'), CHAT, "logprobs"),
    ("chat: max_completion_tokens 0", chat('"max_completion_tokens": 0'), CHAT, "max_completion_tokens"),
    ("chat: max_tokens 0", chat('"max_tokens": 0'), CHAT, "max_tokens"),
    ("chat: n 1000", chat('"n": 1000'), CHAT, "n"),
    (
        "chat: duplicate tools",
        chat(
            '"tools": [{"type": "function", "function": {"name": "f"}}, '
            '{"type": "function", "function": {"name": "f"}}]'
        ),
        CHAT,
        "tools",
    ),
    ("chat: tool_choice without tools", chat('"tool_choice": "required"'), CHAT, "tool_choice"),
    (
        "chat: json_schema without its schema",
        chat('"response_format": {"type": "json_schema"}'),
        CHAT,
        "response_format",
    ),
]


@pytest.mark.parametrize("body, kind, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(body, kind, param):
    with pytest.raises(InvalidRequestError) as info:
        decode_request(body, kind)
    e = info.value
    assert e.param == param, str(e)
    assert str(e)
    if param is None and body[:1] not in (b"[", b'"'):
        assert str(e).startswith("Invalid JSON")
    api = errors.from_invalid_request(e)
    assert api.status == 400
    assert json.loads(errors.error_body(e)) == {
        "error": {"message": str(e), "type": "invalid_request_error", "param": param, "code": None}
    }


def test_messages_name_the_field():
    with pytest.raises(InvalidRequestError, match="max_tokens.*Expected `int"):
        decode_request(cmpl('"max_tokens": "10"'), CMPL)
    with pytest.raises(InvalidRequestError, match="not supported"):
        decode_request(cmpl('"best_of": 2'), CMPL)
    with pytest.raises(InvalidRequestError, match="JSON object"):
        decode_request(b"[]", CMPL)


def test_body_too_large_is_413():
    with pytest.raises(errors.APIError) as info:
        decode_request(b" " * (MAX_BODY_BYTES + 1), CMPL)
    assert info.value.status == 413


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, prompts):
    req = decode_request(json.dumps({"prompt": prompt, "user": "u1", "unknown_field": 1}).encode(), CMPL)
    assert req.prompts == prompts
    assert req.to_sampling_params() == SamplingParams(max_tokens=16)


def test_completion_to_sampling_params():
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 32,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"15": -100, "7": 2.5},
        "stop": ["\n", "END"],
        "stop_token_ids": [2, 3],
        "ignore_eos": True,
        "min_tokens": 4,
        "logprobs": 5,
        "n": MAX_N,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "best_of": 1,
        "suffix": "",
    }
    req = decode_request(json.dumps(body).encode(), CMPL)
    assert req.stop_strings == ["\n", "END"]
    assert req.stream_options.include_usage and req.echo and req.n == MAX_N
    assert req.to_sampling_params() == SamplingParams(
        max_tokens=32,
        min_tokens=4,
        temperature=0.0,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={15: -100.0, 7: 2.5},
        stop_token_ids=(2, 3),
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=5,  # echo: the prompt's logprobs too
    )


def test_max_tokens_0_scores_a_prompt_that_fills_the_context_window():
    """lm-eval scores full-length contexts with echo, logprobs and max_tokens 0 (issue 60): the token the engine
    samples after the prompt needs no room, so max_model_len prompt tokens fit and one more does not."""
    params = decode_request(cmpl('"max_tokens": 0, "echo": true, "logprobs": 1'), CMPL).to_sampling_params()
    limits = RequestLimits(max_model_len=64, vocab_size=100, num_kv_blocks=4, block_size=16)
    limits.check([7] * 64, params)
    with pytest.raises(InvalidRequestError) as e:
        limits.check([7] * 65, params)
    assert (str(e.value), e.value.param) == (
        (
            "This model's maximum context length is 64 tokens. However, you requested 65 tokens (65 in the prompt, 0 for "
            "the completion). Please reduce the prompt or max_tokens."
        ),
        "prompt",
    )
    one = decode_request(cmpl('"max_tokens": 1'), CMPL).to_sampling_params()
    with pytest.raises(
        InvalidRequestError, match=r"you requested 65 tokens \(64 in the prompt, 1 for the completion\)"
    ):
        limits.check([7] * 64, one)


def test_nulls_mean_defaults():
    req = decode_request(
        cmpl('"max_tokens": null, "temperature": null, "top_p": null, "seed": null, "stop": null, "logit_bias": null'),
        CMPL,
    )
    assert req.stop_strings == []
    assert req.to_sampling_params() == SamplingParams()
    assert req.to_sampling_params(default_max_tokens=100).max_tokens == 100
    assert decode_request(cmpl('"stop": "##"'), CMPL).stop_strings == ["##"]


def test_chat_decodes():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None},
            {"role": "developer", "content": "d", "name": "dev"},
        ],
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "logprobs": True,
        "top_logprobs": 3,
        "stop": "x",
        "logit_bias": {"5": 1},
        "tools": [],
        "response_format": {"type": "text"},
        "user": "me",
    }
    req = decode_request(json.dumps(body).encode(), CHAT)
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere"},
        {"role": "assistant", "content": ""},
        {"role": "developer", "content": "d"},
    ]
    assert req.stop_strings == ["x"]
    sp = req.to_sampling_params()
    assert (sp.max_tokens, sp.logprobs, sp.logit_bias) == (20, 3, {5: 1.0})  # max_completion_tokens wins


def test_chat_defaults():
    req = decode_request(chat(""), CHAT)
    assert req.to_sampling_params(default_max_tokens=500) == SamplingParams(max_tokens=500)
    assert decode_request(chat('"logprobs": true'), CHAT).to_sampling_params().logprobs == 0
    assert decode_request(chat('"top_logprobs": 0'), CHAT).to_sampling_params().logprobs is None
    assert decode_request(chat('"min_tokens": 50'), CHAT).to_sampling_params(default_max_tokens=60).min_tokens == 50


def enc(struct) -> dict:
    return json.loads(msgspec.json.encode(struct))


HEAD = {"id": "x-1", "created": 1700000000, "model": "m"}


def test_completion_response_json():
    lp = CompletionLogprobs(tokens=["a"], token_logprobs=[-0.5], top_logprobs=[{"a": -0.5}], text_offset=[0])
    resp = CompletionResponse(
        **HEAD, choices=[CompletionChoice(index=0, text="a", logprobs=lp, finish_reason="length")], usage=Usage.of(3, 1)
    )
    assert enc(resp) == {
        "id": "x-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "a",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["a"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"a": -0.5}],
                    "text_offset": [0],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def test_completion_chunk_json():
    chunk = CompletionChunk(**HEAD, choices=[CompletionChoice(index=1, text="b")])
    assert enc(chunk) == {
        "id": "x-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 1, "text": "b", "logprobs": None, "finish_reason": None}],
    }
    assert enc(CompletionChunk(**HEAD, choices=[], usage=None))["usage"] is None


def test_chat_chunks_json():
    head = {"id": "x-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    role = ChatCompletionChunk(
        **HEAD, choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))]
    )
    assert enc(role) == {
        **head,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    content = ChatCompletionChunk(**HEAD, choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="Hi"))], usage=None)
    assert enc(content) == {
        **head,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
        "usage": None,
    }
    last = ChatCompletionChunk(**HEAD, choices=[ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="stop")])
    assert enc(last)["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    usage = ChatCompletionChunk(**HEAD, choices=[], usage=Usage.of(5, 2))
    assert enc(usage) == {
        **head,
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def test_chat_response_and_models_json():
    resp = ChatCompletionResponse(
        **HEAD,
        choices=[ChatChoice(index=0, message=ChatResponseMessage(content="Hi"), finish_reason="stop")],
        usage=Usage.of(5, 1),
    )
    assert enc(resp)["object"] == "chat.completion"
    assert enc(resp)["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": None, "finish_reason": "stop"}
    ]
    models = ModelList(data=[ModelCard(id="smollm2", created=1)])
    assert enc(models) == {
        "object": "list",
        "data": [{"id": "smollm2", "object": "model", "created": 1, "owned_by": "orcinus"}],
    }


def http_request(method="GET", path="/v1/nope") -> Request:
    return Request({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""})


@pytest.mark.parametrize(
    "exc, status, type_, code",
    [
        (errors.invalid_request("bad", "n"), 400, "invalid_request_error", None),
        (errors.authentication_error(), 401, "authentication_error", "invalid_api_key"),
        (errors.model_not_found("gpt-9"), 404, "not_found_error", "model_not_found"),
        (errors.request_too_large(10), 413, "invalid_request_error", "request_too_large"),
        (errors.rate_limited(retry_after=2.5), 429, "rate_limit_error", "rate_limit_exceeded"),
        (errors.service_unavailable(), 503, "service_unavailable_error", "service_unavailable"),
        (errors.internal_error(), 500, "server_error", "internal_error"),
    ],
)
def test_api_errors(exc, status, type_, code):
    resp = asyncio.run(errors.handle_api_error(http_request(), exc))
    assert resp.status_code == status
    assert resp.media_type == "application/json"
    body = json.loads(resp.body)
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code)
    assert resp.headers.get("retry-after") == ("3" if status == 429 else None)


def test_invalid_request_handler():
    resp = asyncio.run(errors.handle_api_error(http_request(), InvalidRequestError("n is bad", "n")))
    assert resp.status_code == 400
    assert json.loads(resp.body) == {
        "error": {"message": "n is bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


def test_starlette_http_exceptions():
    resp = asyncio.run(errors.handle_http_exception(http_request(), HTTPException(404)))
    assert resp.status_code == 404
    assert json.loads(resp.body)["error"] == {
        "message": "Unknown route: GET /v1/nope",
        "type": "not_found_error",
        "param": None,
        "code": None,
    }
    resp = asyncio.run(
        errors.handle_http_exception(http_request("PUT", "/v1/models"), HTTPException(405, headers={"Allow": "GET"}))
    )
    assert resp.status_code == 405 and resp.headers["allow"] == "GET"
    assert json.loads(resp.body)["error"]["code"] == "method_not_allowed"
    resp = asyncio.run(errors.handle_unexpected(http_request(), RuntimeError("secret detail")))
    assert resp.status_code == 500 and b"secret" not in resp.body


def test_gateway_process_never_imports_torch():
    """The gateway validates and (de)tokenizes; tensors belong to the engine process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gateway.app import load_gateway_tokenizer\n"
        "import gateway.api.completions, gateway.api.chat, gateway.engines.client\n"
        "import engine.ipc.messages, engine.ipc.channel\n"
        "load_gateway_tokenizer(None)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
