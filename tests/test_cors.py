"""CORS: pages on this machine may call the API by default, preflights are answered before the API key
check, an unlisted origin gets no CORS headers, and `--allowed-origins` replaces the default."""

import pytest
from starlette.testclient import TestClient

from gateway.app import GatewayConfig, build_app
from gateway.cli import main as cli_main

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
ALLOW_ORIGIN = "access-control-allow-origin"


def client(**config) -> TestClient:
    # Not entered as a context manager: no engine starts; preflights and key checks never reach a route.
    return TestClient(build_app(GatewayConfig(**config)))


@pytest.mark.parametrize(
    "origin", ["http://localhost:3000", "http://127.0.0.1:5173", "http://localhost", "http://[::1]:8080"]
)
def test_a_page_on_this_machine_gets_its_preflight_answered(origin):
    r = client().options("/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers[ALLOW_ORIGIN] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {
        h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")
    }


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "https://localhost:3000",
        "http://localhost.evil.example",
        "http://127.0.0.1.evil.example:80",
        "null",
    ],
)
def test_an_unlisted_origin_gets_no_cors_headers(origin):
    c = client()
    preflight = c.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
    assert preflight.status_code == 400 and ALLOW_ORIGIN not in preflight.headers
    simple = c.get("/openapi.json", headers={"Origin": origin})
    assert simple.status_code == 200 and ALLOW_ORIGIN not in simple.headers


def test_the_openai_js_sdk_headers_and_a_delete_pass_the_preflight():
    # The SDK adds these to every request from a browser page; DELETE /v1/responses/{id} deletes a stored response.
    sdk = "authorization, content-type, x-stainless-lang, x-stainless-os, x-stainless-runtime, x-stainless-retry-count"
    origin = {"Origin": "http://localhost:3000"}
    c = client()
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/responses/resp_1", "DELETE")):
        r = c.options(
            path, headers={**origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": sdk}
        )
        assert (r.status_code, r.text) == (200, "OK"), (path, method)
        assert r.headers[ALLOW_ORIGIN] == "http://localhost:3000"
        assert method in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"].lower() == sdk


def test_the_api_key_is_still_enforced_and_its_401_is_readable_by_the_page():
    c = client(api_keys=("sekrit",))
    origin = {"Origin": "http://localhost:3000"}
    assert c.options("/v1/completions", headers={**origin, **PREFLIGHT}).status_code == 200  # no key on preflights
    r = c.post("/v1/completions", headers=origin, json={"model": "m", "prompt": "hi"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers[ALLOW_ORIGIN] == "http://localhost:3000"


def test_allowed_origins_replace_the_default():
    c = client(allowed_origins=("https://chat.example.com",))
    ok = c.options("/v1/chat/completions", headers={"Origin": "https://chat.example.com", **PREFLIGHT})
    assert ok.status_code == 200 and ok.headers[ALLOW_ORIGIN] == "https://chat.example.com"
    local = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000", **PREFLIGHT})
    assert local.status_code == 400 and ALLOW_ORIGIN not in local.headers
    none = client(allowed_origins=()).options("/v1/models", headers={"Origin": "http://localhost:3000", **PREFLIGHT})
    assert none.status_code == 400 and ALLOW_ORIGIN not in none.headers


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], None),
        (["--allowed-origins"], ()),
        (["--allowed-origins", "https://a.example", "*"], ("https://a.example", "*")),
    ],
)
def test_the_cli_flag(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr("gateway.cli.run_server", lambda app, **kw: seen.setdefault("app", app))
    monkeypatch.setattr("gateway.engines.replicas.Replicas.launch", lambda self: None)  # no engine process
    monkeypatch.setattr("gateway.app.build_app", lambda config, client: seen.setdefault("config", config))
    assert cli_main(["serve", *argv]) == 0
    assert seen["config"].allowed_origins == want
