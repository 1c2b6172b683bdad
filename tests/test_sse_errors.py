"""gateway/api/serving.sse: however a stream's events fail, the client gets an error event in OpenAI's shape and the
stream's end, never a cut connection; and the stream's close hook runs."""

from __future__ import annotations

import json

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.core.sampling_params import InvalidRequestError
from gateway.api.serving import sse


class Chunk(msgspec.Struct):
    text: str
    type: str = "response.output_text.delta"


def served(failure: Exception, named: bool) -> tuple[list[str], list[str]]:
    closed = []

    async def events():
        yield Chunk("Hi")
        raise failure

    async def route(request):
        return sse(events(), lambda: closed.append(True), drain_timeout=1.0, named=named)

    with TestClient(Starlette(routes=[Route("/s", route)]), raise_server_exceptions=False) as client:
        response = client.get("/s")
    assert response.status_code == 200 and closed == [True]
    return [line for line in response.text.splitlines() if line.startswith(("data:", "event:"))], closed


@pytest.mark.parametrize(
    "failure, code, param",
    [
        (RuntimeError("a bug"), "internal_error", None),
        (RecursionError("maximum recursion depth exceeded"), "internal_error", None),
        (InvalidRequestError("bad stop", "stop"), None, "stop"),
    ],
)
def test_a_failure_mid_stream_ends_with_an_error_event_and_done(failure, code, param):
    lines, _ = served(failure, named=False)
    assert lines[0] == 'data: {"text":"Hi","type":"response.output_text.delta"}'
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    if code == "internal_error":
        assert error["type"] == "server_error" and "a bug" not in error["message"]


def test_a_failure_mid_stream_of_named_events_is_an_error_event():
    lines, _ = served(RuntimeError("a bug"), named=True)
    assert lines[:2] == ["event: response.output_text.delta", 'data: {"text":"Hi","type":"response.output_text.delta"}']
    assert lines[-2] == "event: error"
    assert json.loads(lines[-1].removeprefix("data: ")) == {
        "type": "error",
        "code": "internal_error",
        "message": "The server had an internal error.",
        "param": None,
    }
