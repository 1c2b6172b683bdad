"""The HTTP contract: /openapi.json comes from the msgspec structs, and schemathesis, fuzzing a live server from
it, finds no 5xx and no response outside it. The server takes its API key from ORCINUS_API_KEY and guards
/metrics with it too, so the fuzzer also checks that every secured route refuses a missing key."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

KEY = "fuzz-key"
BIN = Path(sys.executable).parent
# Every check about responses; plus: schema-invalid data gets a 4xx, and secured routes need the key.
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance,negative_data_rejection,ignored_auth"
)


@pytest.fixture(scope="module")
def keyed_server(server_factory):
    # A small context window keeps every generation the fuzzer asks for short (a chat prompt is 33 tokens, the
    # document's chat examples fit in 40); one torch thread keeps the engine fast when other work shares the
    # 2 cores (see test_hardening.py). The contract is the model's business nowhere, so the model is the tiny
    # random one with SmolLM2's tokenizer: the ~160 whole generations of the coverage phase took 50 of its 60 s
    # with the default model.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCINUS_API_KEY", KEY)
        with server_factory(
            "--model",
            "dummy:tiny",
            "--max-model-len",
            "40",
            "--metrics-need-key",
            "--num-threads",
            "1",
            "--enable-lora",  # the adapter routes are fuzzed too
        ) as url:
            mp.delenv("ORCINUS_API_KEY")
            yield url


def test_document_describes_routes_errors_and_streams(keyed_server):
    doc = httpx.get(f"{keyed_server}/openapi.json", timeout=10).json()  # open without the key
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/{model}",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/health",
        "/metrics",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
    responses = doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert responses["required"] == ["event", "data"]  # typed events, no [DONE]
    op = doc["paths"]["/v1/completions"]["post"]
    assert set(op["responses"]) == {"200", "400", "401", "404", "408", "413", "415", "429", "503"}
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert op["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert op["security"] == [{"bearer": []}]
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    assert schemas["CompletionRequest"]["properties"]["n"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 16,
        "default": 1,
    }
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]


def test_key_from_environment_guards_v1_and_metrics_but_not_health(keyed_server):
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(keyed_server + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(keyed_server + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    assert httpx.get(f"{keyed_server}/health", timeout=10).json() == {"status": "ok"}


def test_schemathesis_finds_no_server_error_and_no_response_outside_the_schema(keyed_server, tmp_path):
    har = tmp_path / "run.har"
    # One worker: Python 3.11.7's ast module is not thread-safe ("AST constructor recursion depth mismatch",
    # CPython gh-106905, fixed in 3.11.8), and hypothesis uses it while generating.
    proc = subprocess.run(
        [
            str(BIN / "st"),
            "run",
            f"{keyed_server}/openapi.json",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--checks",
            CHECKS,
            "--max-examples",
            "10",
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "120",
            "--report",
            "har",
            "--report-har-path",
            str(har),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # The run meant something: every route answered, and real generations ran, whole and streamed (the
    # document's request examples seed them), so every response kind was checked against the schema.
    entries = json.loads(har.read_text())["log"]["entries"]
    seen = collections.Counter(
        (
            e["request"]["url"].split(keyed_server, 1)[1],
            e["response"]["status"],
            e["response"]["content"].get("mimeType", "").split(";")[0],
        )
        for e in entries
    )
    for path in ("/v1/completions", "/v1/chat/completions"):
        for status, kind in (
            (200, "application/json"),
            (200, "text/event-stream"),
            (400, "application/json"),
            (401, "application/json"),
        ):
            assert seen[(path, status, kind)] > 0, (path, status, kind, seen)
    for path in ("/v1/models", "/metrics", "/health"):
        assert seen[(path, 200, "application/json" if path != "/metrics" else "text/plain")] > 0, seen
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # no adapter at the paths it sends
        assert seen[(path, 400, "application/json")] > 0 and seen[(path, 401, "application/json")] > 0, seen


def test_the_lora_routes_and_their_bodies_are_documented_where_they_exist():
    """The document lists exactly the app's routes, with LoRA on (vLLM's two adapter routes) and off (neither)."""
    from starlette.testclient import TestClient

    from engine.core.config import EngineConfig
    from gateway.app import build_app
    from gateway.config import GatewayConfig

    lora_paths = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    for lora in (False, True):
        app = build_app(GatewayConfig(EngineConfig(enable_lora=lora)))
        doc = TestClient(app).get("/openapi.json").json()  # no lifespan: no engine starts
        routes = {r.path.replace(":path", "") for r in app.routes} - {"/", "/openapi.json"}
        assert set(doc["paths"]) == routes and bool(lora_paths & routes) == lora
    schemas, paths = doc["components"]["schemas"], doc["paths"]
    assert set(schemas["LoadLoraAdapterRequest"]["properties"]) == {"lora_name", "lora_path"}
    assert set(schemas["UnloadLoraAdapterRequest"]["properties"]) == {"lora_name"}
    load, unload = paths["/v1/load_lora_adapter"]["post"], paths["/v1/unload_lora_adapter"]["post"]
    assert load["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/LoadLoraAdapterRequest"
    }
    assert unload["requestBody"]["content"]["application/json"]["examples"] == {
        "unload": {"value": {"lora_name": "sql"}}
    }
    assert load["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}, "example": "Success: LoRA adapter 'sql' added successfully."}
    }
    assert set(load["responses"]) == {"200", "400", "408", "413", "415", "503"}
    assert set(unload["responses"]) == {"200", "400", "404", "408", "413", "415"}
