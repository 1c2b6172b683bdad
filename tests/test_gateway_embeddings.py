"""POST /v1/embeddings on the shared server through the OpenAI SDK: unit-norm vectors of the model's hidden size,
a list batched like its items alone, base64 the same float32 values, `dimensions` truncated and normalised again,
usage, and OpenAI-shaped 400/404 bodies for bad input. (Equality with transformers: tests/test_embeddings.py.)"""

import base64
import math

import httpx
import numpy as np
import pytest

TEXTS = ["The capital of France is", "def fibonacci(n):", "Orcas hunt in pods."]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def error(message: str, param: str | None, type_: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_sdk_string_list_and_usage(client, model, tokenizer):
    one = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == model and len(one.data) == 1
    v = np.array(one.data[0].embedding)
    assert v.size > 0 and abs(np.linalg.norm(v) - 1.0) < 1e-6
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tokenizer.encode(TEXTS[0]))
    many = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert np.abs(np.array(many.data[0].embedding) - v).max() < 1e-5  # batched as alone
    alone = [client.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding for t in TEXTS]
    for d, a in zip(many.data, alone):
        assert np.abs(np.array(d.embedding) - np.array(a)).max() < 1e-5
    ids = client.embeddings.create(model=model, input=tokenizer.encode(TEXTS[0]), encoding_format="float")
    assert ids.data[0].embedding == one.data[0].embedding  # token ids embed as their text does


def test_base64_is_the_same_float32_values(client, model, http):
    floats = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float").data[0].embedding
    raw = http.post("/v1/embeddings", json={"model": model, "input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats
    # The SDK asks for base64 by default and decodes it itself.
    assert client.embeddings.create(model=model, input=TEXTS[1]).data[0].embedding == floats


def test_dimensions_truncate_then_normalise(client, model, http):
    full = client.embeddings.create(model=model, input=TEXTS[2], encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=model, input=TEXTS[2], dimensions=8, encoding_format="float").data[0]
    norm = math.sqrt(sum(x * x for x in full[:8]))
    assert len(short.embedding) == 8
    assert np.abs(np.array(short.embedding) - np.array(full[:8]) / norm).max() < 1e-6
    r = http.post("/v1/embeddings", json={"model": model, "input": "x", "dimensions": len(full) + 1})
    assert r.status_code == 400 and r.json() == error(
        f"dimensions must be at most {len(full)}, this model's embedding size", "dimensions"
    )


def test_bad_input_gets_openai_errors(http, model):
    def post(body: dict) -> httpx.Response:
        return http.post("/v1/embeddings", json={"model": model, **body})

    empty = error("input must not contain an empty string or list", "input")
    for body in ({"input": ""}, {"input": ["a", ""]}, {"input": [[1, 2], []]}):
        r = post(body)
        assert r.status_code == 400 and r.json() == empty, body
    r = post({"input": []})
    assert r.status_code == 400 and r.json() == error("input must not be empty", "input")
    r = post({"input": ["a", [1]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    limit = http.get("/tokenizer_info").json()["model_max_length"]
    r = post({"input": [1] * (limit + 1)})
    assert r.status_code == 400 and r.json() == error(
        f"This model's maximum context length is {limit} tokens. However, you requested {limit + 1} tokens "
        f"({limit + 1} in the prompt, 0 for the completion). Please reduce the prompt or max_tokens.",
        "input",
    )
    r = post({"input": "x", "encoding_format": "int8"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
    assert r.status_code == 404 and r.json() == error(
        "The model `text-embedding-3-small` does not exist.", "model", "not_found_error", "model_not_found"
    )


def test_langchain_client(server, model):
    embeddings = pytest.importorskip("langchain_openai")
    lc = embeddings.OpenAIEmbeddings(
        model=model, base_url=f"{server}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    vectors = lc.embed_documents(TEXTS[:2])
    assert len(vectors) == 2 and abs(np.linalg.norm(vectors[0]) - 1.0) < 1e-5
