"""Bad requests against the live gateway: exact status, OpenAI's four-key error body, the offending `param`;
and the API key. Uses the `server` and `server_factory` fixtures of conftest.py."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
M = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
INVALID = "invalid_request_error"


def chunked(parts):
    yield from parts


# (id, method, path, body: dict | bytes | None, status, type, param, code); param/code "ANY" = not checked.
CASES = [
    # malformed bodies
    ("malformed json", "POST", CMPL, b'{"prompt": "Hi", ', 400, INVALID, None, None),
    ("json array body", "POST", CMPL, b'["Hi"]', 400, INVALID, None, None),
    ("json null body", "POST", CHAT, b"null", 400, INVALID, None, None),
    ("empty body", "POST", CMPL, b"", 400, INVALID, None, None),
    ("invalid utf-8 in a string", "POST", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, INVALID, None, None),
    ("NaN literal", "POST", CMPL, b'{"prompt": "Hi", "temperature": NaN}', 400, INVALID, None, None),
    ("missing prompt", "POST", CMPL, {"model": MODEL, "max_tokens": 2}, 400, INVALID, "prompt", None),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, INVALID, "messages", None),
    # wrong types
    ("max_tokens string", "POST", CMPL, {**P, "max_tokens": "5"}, 400, INVALID, "max_tokens", None),
    ("max_tokens bool", "POST", CMPL, {**P, "max_tokens": True}, 400, INVALID, "max_tokens", None),
    ("n float", "POST", CMPL, {**P, "n": 1.5}, 400, INVALID, "n", None),
    ("stream yes", "POST", CMPL, {**P, "stream": "yes"}, 400, INVALID, "stream", None),
    ("prompt number", "POST", CMPL, {**P, "prompt": 3}, 400, INVALID, "prompt", None),
    ("mixed prompt list", "POST", CMPL, {**P, "prompt": ["a", 1]}, 400, INVALID, "prompt", None),
    ("messages string", "POST", CHAT, {**M, "messages": "hello"}, 400, INVALID, "messages", None),
    ("temperature string", "POST", CHAT, {**M, "temperature": "hot"}, 400, INVALID, "temperature", None),
    # out of range
    ("max_tokens negative", "POST", CMPL, {**P, "max_tokens": -1}, 400, INVALID, "max_tokens", None),
    ("max_tokens zero", "POST", CMPL, {**P, "max_tokens": 0}, 400, INVALID, "max_tokens", None),
    (
        "max_completion_tokens zero",
        "POST",
        CHAT,
        {**M, "max_completion_tokens": 0},
        400,
        INVALID,
        "max_completion_tokens",
        None,
    ),
    ("n 0", "POST", CMPL, {**P, "n": 0}, 400, INVALID, "n", None),
    ("n 100", "POST", CMPL, {**P, "n": 100}, 400, INVALID, "n", None),
    ("huge n", "POST", CHAT, {**M, "n": 10**6}, 400, INVALID, "n", None),
    ("temperature 3", "POST", CMPL, {**P, "temperature": 3}, 400, INVALID, "temperature", None),
    ("temperature negative", "POST", CHAT, {**M, "temperature": -0.5}, 400, INVALID, "temperature", None),
    ("top_p 0", "POST", CMPL, {**P, "top_p": 0}, 400, INVALID, "top_p", None),
    ("top_k -2", "POST", CMPL, {**P, "top_k": -2}, 400, INVALID, "top_k", None),
    ("top_k beyond int64", "POST", CMPL, {**P, "top_k": 10**30}, 400, INVALID, "top_k", None),
    ("presence_penalty 5", "POST", CMPL, {**P, "presence_penalty": 5}, 400, INVALID, "presence_penalty", None),
    ("min_tokens over max_tokens", "POST", CMPL, {**P, "min_tokens": 10}, 400, INVALID, "min_tokens", None),
    ("seed beyond int64", "POST", CMPL, {**P, "seed": 2**64}, 400, INVALID, "seed", None),
    ("logprobs 21", "POST", CMPL, {**P, "logprobs": 21}, 400, INVALID, "logprobs", None),
    ("prompt_logprobs 21", "POST", CMPL, {**P, "prompt_logprobs": 21}, 400, INVALID, "prompt_logprobs", None),
    ("top_logprobs 30", "POST", CHAT, {**M, "logprobs": True, "top_logprobs": 30}, 400, INVALID, "top_logprobs", None),
    ("top_logprobs without logprobs", "POST", CHAT, {**M, "top_logprobs": 2}, 400, INVALID, "top_logprobs", None),
    ("stop list of 65", "POST", CMPL, {**P, "stop": [f"s{i}" for i in range(65)]}, 400, INVALID, "stop", None),
    ("empty stop string", "POST", CMPL, {**P, "stop": [""]}, 400, INVALID, "stop", None),
    (
        "stream_options without stream",
        "POST",
        CMPL,
        {**P, "stream_options": {"include_usage": True}},
        400,
        INVALID,
        "stream_options",
        None,
    ),
    # prompts
    ("empty prompt string", "POST", CMPL, {**P, "prompt": ""}, 400, INVALID, "prompt", None),
    ("empty prompt list", "POST", CMPL, {**P, "prompt": []}, 400, INVALID, "prompt", None),
    ("empty token-id prompt", "POST", CMPL, {**P, "prompt": [[]]}, 400, INVALID, "prompt", None),
    ("65 prompts", "POST", CMPL, {**P, "prompt": ["Hi"] * 65}, 400, INVALID, "prompt", None),
    ("over-long text prompt", "POST", CMPL, {**P, "prompt": "hi " * 9000}, 400, INVALID, "prompt", None),
    ("over-long token-id prompt", "POST", CMPL, {**P, "prompt": [42] * 9000}, 400, INVALID, "prompt", None),
    (
        "over-long prompt, max_tokens null",
        "POST",
        CMPL,
        {**P, "prompt": [42] * 9000, "max_tokens": None},
        400,
        INVALID,
        "prompt",
        None,
    ),
    ("max_tokens exceeds context", "POST", CMPL, {**P, "max_tokens": 8192}, 400, INVALID, "prompt", None),
    ("chat max_tokens exceeds context", "POST", CHAT, {**M, "max_tokens": 9000}, 400, INVALID, "messages", None),
    ("token id -1", "POST", CMPL, {**P, "prompt": [5, -1]}, 400, INVALID, "prompt[1]", None),
    ("token id 10**9", "POST", CMPL, {**P, "prompt": [5, 10**9]}, 400, INVALID, "prompt", None),
    ("token id = vocab", "POST", CMPL, {**P, "prompt": [[5], [VOCAB]]}, 400, INVALID, "prompt", None),
    # logit_bias / stop ids
    ("logit_bias word key", "POST", CMPL, {**P, "logit_bias": {"hello": 1}}, 400, INVALID, "logit_bias", None),
    ("logit_bias negative key", "POST", CMPL, {**P, "logit_bias": {"-3": 1}}, 400, INVALID, "logit_bias", None),
    ("logit_bias id >= vocab", "POST", CMPL, {**P, "logit_bias": {str(VOCAB): 1}}, 400, INVALID, "logit_bias", None),
    ("logit_bias value 1000", "POST", CHAT, {**M, "logit_bias": {"5": 1000}}, 400, INVALID, "logit_bias", None),
    ("stop_token_ids >= vocab", "POST", CMPL, {**P, "stop_token_ids": [VOCAB]}, 400, INVALID, "stop_token_ids", None),
    ("priority not an int", "POST", CHAT, {**M, "priority": "high"}, 400, INVALID, "priority", None),
    ("priority past int32", "POST", CMPL, {**P, "priority": 2**31}, 400, INVALID, "priority", None),
    # unsupported
    ("best_of 2", "POST", CMPL, {**P, "best_of": 2}, 400, INVALID, "best_of", None),
    ("suffix", "POST", CMPL, {**P, "suffix": "x"}, 400, INVALID, "suffix", None),
    (
        "max_tokens 0 with min_tokens",
        "POST",
        CMPL,
        {**P, "max_tokens": 0, "echo": True, "min_tokens": 1},
        400,
        INVALID,
        "min_tokens",
        None,
    ),
    # compiled in the gateway's pool after decoding, still a 400 naming the field
    (
        "schema that does not compile",
        "POST",
        CHAT,
        {**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
        400,
        INVALID,
        "response_format",
        None,
    ),
    (
        "tool without a function",
        "POST",
        CHAT,
        {**M, "tools": [{"type": "function"}]},
        400,
        INVALID,
        "tools[0].function",
        None,
    ),
    (
        "unknown tool_choice",
        "POST",
        CHAT,
        {
            **M,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        INVALID,
        "tool_choice",
        None,
    ),
    (
        "response_format type",
        "POST",
        CHAT,
        {**M, "response_format": {"type": "xml"}},
        400,
        INVALID,
        "response_format.type",
        None,
    ),
    # messages
    ("empty messages", "POST", CHAT, {**M, "messages": []}, 400, INVALID, "messages", None),
    (
        "unknown role",
        "POST",
        CHAT,
        {**M, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        INVALID,
        "messages[0].role",
        None,
    ),
    (
        "user without content",
        "POST",
        CHAT,
        {**M, "messages": [{"role": "user"}]},
        400,
        INVALID,
        "messages[0].content",
        None,
    ),
    (
        "image content part",
        "POST",
        CHAT,
        {**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        INVALID,
        "messages[0].content[0].type",
        None,
    ),
    ("message missing role", "POST", CHAT, {**M, "messages": [{"content": "x"}]}, 400, INVALID, "ANY", None),
    # model
    ("unknown model", "POST", CMPL, {**P, "model": "gpt-4"}, 404, "not_found_error", "model", "model_not_found"),
    ("unknown chat model", "POST", CHAT, {**M, "model": "nope"}, 404, "not_found_error", "model", "model_not_found"),
    # routes and methods
    ("unknown route", "POST", "/v1/images/generations", {"prompt": "x"}, 404, "not_found_error", None, None),
    ("unknown top-level route", "GET", "/nope", None, 404, "not_found_error", None, None),
    ("GET on completions", "GET", CMPL, None, 405, INVALID, None, "method_not_allowed"),
    ("GET on chat", "GET", CHAT, None, 405, INVALID, None, "method_not_allowed"),
    ("POST on models", "POST", "/v1/models", None, 405, INVALID, None, "method_not_allowed"),
    # size
    (
        "body over 4 MiB",
        "POST",
        CMPL,
        b'{"prompt": "' + b"a" * (4 * 2**20) + b'"}',
        413,
        INVALID,
        None,
        "request_too_large",
    ),
    ("chunked body over 4 MiB", "POST", CHAT, "chunked", 413, INVALID, None, "request_too_large"),
]


def assert_openai_error(r: httpx.Response, status: int, type_: str, param, code) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_, err
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if param != "ANY":
        assert err["param"] == param, err
    if code != "ANY":
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.mark.parametrize("method,path,body,status,type_,param,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(http, method, path, body, status, type_, param, code):
    if body == "chunked":  # no content-length: the limit must hold while reading
        content = (b"a" * 2**20 if i else b'{"messages": "' for i in range(6))
        r = http.request(method, path, content=content, headers={"content-type": "application/json"})
    elif isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    elif body is None:
        r = http.request(method, path)
    else:
        r = http.request(method, path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert_openai_error(r, status, type_, param, code)


def test_error_table_is_large_enough():
    assert len(CASES) >= 25


def test_good_requests_still_succeed_after_the_bad_ones(http):
    r = http.post(CMPL, json={**P, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = http.post(CHAT, json={**M, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert http.get("/health").status_code == 200


def test_large_but_valid_top_k_seed_and_priority_work(http):
    r = http.post(CMPL, json={**P, "top_k": 10**6, "seed": 2**63 - 1, "n": 2, "temperature": 0.7, "priority": -5})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_streaming_request_validation_error_is_plain_json(http):
    """Validation errors come before the stream starts: a plain JSON 400, not an SSE event."""
    r = http.post(CMPL, json={**P, "stream": True, "n": 0})
    assert_openai_error(r, 400, INVALID, "n", None)


# ---------------------------------------------------------------- API key


@pytest.fixture(scope="module")
def keyed_server(server_factory):
    with server_factory("--api-key", "secret", "--served-model-name", "my-model") as url:
        yield url


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "secret"},
        {"Authorization": "Bearer secret2"},
        {"Authorization": "Basic secret"},
    ],
    ids=["missing", "wrong", "no-bearer", "longer", "basic"],
)
@pytest.mark.parametrize("method,path", [("POST", CMPL), ("POST", CHAT), ("GET", "/v1/models")])
def test_api_key_required(keyed_server, headers, method, path):
    body = (
        {"model": "my-model", "prompt": "Hi", "max_tokens": 1}
        if path == CMPL
        else {"model": "my-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    )
    r = httpx.request(method, keyed_server + path, headers=headers, json=body if method == "POST" else None, timeout=60)
    assert_openai_error(r, 401, "authentication_error", None, "invalid_api_key")


def test_api_key_accepted_and_health_open(keyed_server):
    import openai

    assert httpx.get(f"{keyed_server}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed_server}/metrics", timeout=10).status_code == 401  # with a key, /metrics needs it too
    assert (
        httpx.get(f"{keyed_server}/metrics", headers={"Authorization": "Bearer secret"}, timeout=10).status_code == 200
    )
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="secret", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["my-model"]
    r = client.completions.create(model="my-model", prompt="Hi", max_tokens=2, temperature=0)
    assert r.model == "my-model" and r.choices[0].text is not None
    chat = client.chat.completions.create(
        model="my-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    # The served name is the only model: the default name is now unknown.
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"

    bad = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("chunked_body", [False, True], ids=["content-length", "chunked"])
def test_a_client_that_writes_its_whole_body_first_still_reads_the_413(server, chunked_body):
    """urllib sends all 50 MB before it reads a byte: the server drains the refused body so the 413 reaches it
    instead of a connection reset (and then serves the next request)."""
    import urllib.error
    import urllib.request

    body = b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'
    data = iter([body[i : i + 2**20] for i in range(0, len(body), 2**20)]) if chunked_body else body
    headers = {"Content-Type": "application/json"}
    if chunked_body:
        headers["Transfer-Encoding"] = "chunked"
    req = urllib.request.Request(f"{server}{CMPL}", data=data, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 413
    assert json.loads(e.value.read())["error"]["code"] == "request_too_large"
    ok = httpx.post(f"{server}{CMPL}", json={"prompt": "Hi", "max_tokens": 1}, timeout=120)
    assert ok.status_code == 200
