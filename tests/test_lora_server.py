"""LoRA adapters over HTTP: --lora serves one as a model name beside the base model (listed by /v1/models with its
parent), completions, chat and Responses run under the adapter their `model` names, an unknown name is a 404, and
adapters load and unload at run time behind the API key (vLLM's routes, bodies and status codes)."""

import json
import re
import time

import httpx
import pytest
import torch

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


def write_adapter(path, seed: int, rank: int = 8) -> str:
    """A random rank-`rank` adapter on the bundled model's Q and V projections, in PEFT's files."""
    from safetensors.torch import save_file

    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(30):
        for module, out in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 576, generator=g) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.05
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": write_adapter(root / "a", 1), "b": write_adapter(root / "b", 2)}


@pytest.fixture(scope="module")
def lora_server(server_factory, adapters):
    """One adapter from the start and a single slot, so a second one swaps it out."""
    with server_factory("--lora", f"a={adapters['a']}", "--max-loras", "1", "--api-key", KEY) as url:
        yield url


def complete(url: str, model: str | None, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_models_lists_the_adapters_with_their_parent(lora_server):
    data = httpx.get(f"{lora_server}/v1/models", headers=AUTH, timeout=10).json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m.get("parent")) for m in data] == [(base, None), ("a", base)]
    card = httpx.get(f"{lora_server}/v1/models/a", headers=AUTH, timeout=10).json()
    assert card["id"] == "a" and card["parent"] == base


def test_the_model_field_picks_the_adapter_in_every_endpoint(lora_server):
    base = httpx.get(f"{lora_server}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
    plain, named, under_a = complete(lora_server, None), complete(lora_server, base), complete(lora_server, "a")
    assert plain.status_code == named.status_code == under_a.status_code == 200, under_a.text
    assert plain.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    assert under_a.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]
    assert under_a.json()["model"] == "a" and plain.json()["model"] == base
    chat = httpx.post(
        f"{lora_server}/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=AUTH,
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "a", chat.text
    resp = httpx.post(
        f"{lora_server}/v1/responses",
        json={"model": "a", "input": "Hi", "max_output_tokens": 4},
        headers=AUTH,
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["model"] == "a", resp.text


def test_structured_outputs_hold_under_an_adapter(lora_server):
    """A grammar constrains an adapter's rows as it does the base model's: the answer parses and fits the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    r = httpx.post(
        f"{lora_server}/v1/chat/completions",
        json={
            "model": "a",
            "messages": [{"role": "user", "content": "Where is the Eiffel tower?"}],
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        },
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["model"] == "a", r.text
    choice = r.json()["choices"][0]
    answer = json.loads(choice["message"]["content"])
    assert choice["finish_reason"] == "stop"
    assert (
        set(answer) == {"city", "sunny"} and answer["city"] in ("Paris", "Rome") and isinstance(answer["sunny"], bool)
    )


def requests_by_model(url: str) -> tuple[list[str], dict[str, float]]:
    """/metrics' orcinus_requests_total family as written (its lines), and its value per model."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    lines = [line for line in text.splitlines() if re.match(r"(# (HELP|TYPE) )?orcinus_requests_total[{ ]", line)]
    values = {}
    for line in lines[2:]:
        model, value = re.fullmatch(r'orcinus_requests_total\{model="(.*)"\} (\S+)', line).groups()
        values[model] = float(value)
    return lines, values


def test_metrics_count_requests_by_the_model_they_run_under(lora_server):
    """orcinus_requests_total{model}: the adapter's name for a request under it, the base model's for the others;
    both series are there from the start."""
    _, counts = requests_by_model(lora_server)
    base = httpx.get(f"{lora_server}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
    assert list(counts)[:2] == [base, "a"]
    for model in ("a", None, "a"):
        assert complete(lora_server, model, max_tokens=1).status_code == 200
    assert complete(lora_server, "nope").status_code == 404  # not admitted: counted nowhere
    counts[base] += 1
    counts["a"] += 2
    after, _ = requests_by_model(lora_server)
    assert after == [
        (
            "# HELP orcinus_requests_total Requests admitted, by the model they run under: the base model's name or a "
            "LoRA adapter's"
        ),
        "# TYPE orcinus_requests_total counter",
        *(f'orcinus_requests_total{{model="{model}"}} {n}' for model, n in counts.items()),
    ]


def test_an_unknown_model_is_a_404_in_openai_shape(lora_server):
    want = {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    r = complete(lora_server, "nope")
    assert (r.status_code, r.json()) == (404, want)
    r = httpx.post(
        f"{lora_server}/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "Hi"}]},
        headers=AUTH,
        timeout=60,
    )
    assert (r.status_code, r.json()) == (404, want)


def test_adapters_load_and_unload_at_run_time(lora_server, adapters, tmp_path):
    url = lora_server
    load, unload = f"{url}/v1/load_lora_adapter", f"{url}/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "b", "lora_path": adapters["b"]}, timeout=60)
    assert r.status_code == 401  # behind the API key
    r = httpx.post(load, json={"lora_name": "b", "lora_path": adapters["b"]}, headers=AUTH, timeout=60)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"]][1:] == ["a", "b"]
    # One slot: a and b take turns in it, each giving its own tokens every time.
    texts = [complete(url, name).json()["choices"][0]["text"] for name in ("a", "b", "a", "b")]
    assert texts[0] == texts[2] and texts[1] == texts[3] and texts[0] != texts[1]

    r = httpx.post(load, json={"lora_name": "b", "lora_path": adapters["b"]}, headers=AUTH, timeout=60)
    assert (r.status_code, r.json()["error"]["message"]) == (400, "The lora adapter 'b' has already been loaded.")
    r = httpx.post(load, json={"lora_name": "c"}, headers=AUTH, timeout=60)
    assert (r.status_code, r.json()["error"]["message"]) == (400, "Both 'lora_name' and 'lora_path' must be provided.")
    r = httpx.post(load, json={"lora_name": "c", "lora_path": str(tmp_path)}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"no LoRA adapter at {tmp_path}")
    assert complete(url, "c").status_code == 404

    r = httpx.post(unload, json={"lora_name": "b"}, headers=AUTH, timeout=60)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    assert complete(url, "b").status_code == 404
    r = httpx.post(unload, json={"lora_name": "b"}, headers=AUTH, timeout=60)
    assert (r.status_code, r.json()) == (
        404,
        {
            "error": {
                "message": "The lora adapter 'b' cannot be found.",
                "type": "not_found_error",
                "param": "lora_name",
                "code": None,
            }
        },
    )
    assert complete(url, "a").json()["choices"][0]["text"] == texts[0]  # the one left still serves


def test_the_adapter_routes_exist_only_where_lora_is_on():
    from engine.core.config import EngineConfig
    from gateway.app import build_app
    from gateway.config import GatewayConfig

    routes = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert not routes & {r.path for r in build_app(GatewayConfig()).routes}
    assert routes <= {r.path for r in build_app(GatewayConfig(EngineConfig(enable_lora=True))).routes}


def stream(url: str, model: str | None, max_tokens: int, started=None) -> dict:
    """One streamed completion: its status, finish reason, completion tokens (usage) and error body, if any;
    `started` is set at its first token."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body |= {"stream_options": {"include_usage": True}} | ({"model": model} if model else {})
    out = {"finish_reason": None, "tokens": None, "error": None}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(r.read())
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event
            elif event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            elif event["choices"]:
                out["finish_reason"] = event["choices"][0]["finish_reason"] or out["finish_reason"]
                if started is not None:
                    started.set()
    return out


def read_tokens(lines, k: int) -> None:
    """Read `k` more token events of an open completion stream; none may be an error."""
    for line in lines:
        if line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["text"] is not None:
                k -= 1
                if k == 0:
                    return
    raise AssertionError("the stream ended")


def test_adapters_load_and_unload_while_others_stream(server_factory, adapters, tmp_path):
    """Streams under a and e hold both slots, so b's requests wait for one. Meanwhile a is unloaded (its stream goes
    on: a request running under an adapter runs to its end; new ones get the 404), b is unloaded (its waiting
    requests get the 404, as a response or as the stream's error event), c is loaded; the streams of a, e and the base
    model go on without an error, and c gets a slot once a's stream is done."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    c, e = write_adapter(tmp_path / "c", 3), write_adapter(tmp_path / "e", 5)
    flags = ("--lora", f"a={adapters['a']}", "--lora", f"b={adapters['b']}", "--lora", f"e={e}", "--max-loras", "2")
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"

    def gone(name: str) -> dict:
        return {
            "error": {
                "message": f"The model `{name}` does not exist.",
                "type": "not_found_error",
                "param": "model",
                "code": "model_not_found",
            }
        }

    with server_factory(*flags, "--api-key", KEY) as url, ThreadPoolExecutor(4) as pool, contextlib.ExitStack() as st:

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)

        def open_stream(model: str):
            """An endless stream under `model` (closed by the test), its lines once its first token came."""
            body = {"model": model, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
            r = st.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120))
            assert r.status_code == 200
            lines = r.iter_lines()
            read_tokens(lines, 1)
            return r, lines

        base = pool.submit(stream, url, None, 24)
        (a_resp, a_lines), (_, e_lines) = open_stream("a"), open_stream("e")
        b1, b2 = pool.submit(complete, url, "b"), pool.submit(stream, url, "b", 8)
        time.sleep(0.5)  # both at the engine, waiting for a slot
        assert post(unload, {"lora_name": "a"}).status_code == 200  # while a's stream runs
        r = complete(url, "a")
        assert (r.status_code, r.json()) == (404, gone("a"))
        assert post(unload, {"lora_name": "b"}).status_code == 200
        r = b1.result()
        assert (r.status_code, r.json()) == (404, gone("b"))
        assert b2.result()["error"] == gone("b")
        assert post(load, {"lora_name": "c", "lora_path": c}).status_code == 200
        read_tokens(a_lines, 4)
        read_tokens(e_lines, 4)
        a_resp.close()  # a's request is aborted: its slot frees for c
        r = complete(url, "c")
        assert r.status_code == 200, r.text
        read_tokens(e_lines, 2)
        assert base.result() == {"status": 200, "finish_reason": "length", "tokens": 24, "error": None}
        models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"]
        assert [m["id"] for m in models][1:] == ["e", "c"]


def test_a_restarted_engine_serves_the_adapters_served_when_it_died(monkeypatch):
    """A --lora adapter unloaded at run time stays gone from the engine that replaces a dead one, and one loaded again
    under its name comes back from its new path (not the flag's), as does one loaded at run time."""
    import asyncio

    from engine.core.config import EngineConfig
    from engine.core.lora_pool import parse_lora
    from engine.ipc.messages import EngineReady, LoadLora, LoraResult, UnloadLora
    from gateway.engines import client as client_module
    from gateway.web.metrics import Metrics

    class FakeProcess:
        """An engine process ready at once, answering every adapter update; keeps its config and what it was sent."""

        def __init__(self, config, on_frame, cache_events=False, devices=None):
            self.config, self.on_frame, self.sent, self.alive, self.unread = config, on_frame, [], True, False

        async def start(self):
            self.on_frame(EngineReady("m", None, None))

        async def wait(self):
            await asyncio.Event().wait()

        def try_send(self, msg) -> bool:
            self.sent.append(msg)
            if isinstance(msg, (LoadLora, UnloadLora)) and msg.op_id:
                self.on_frame(LoraResult(msg.op_id))
            return True

    def served(engine: FakeProcess) -> dict[str, str]:
        """The adapters the engine serves: its --lora, then the loads it got (one of a name it has fails)."""
        names = dict(parse_lora(spec) for spec in engine.config.lora)
        for msg in engine.sent:
            if isinstance(msg, LoadLora) and msg.name not in names:
                names[msg.name] = msg.path
        return names

    monkeypatch.setattr(client_module, "EngineProcess", FakeProcess)

    async def scenario():
        client = client_module.EngineClient(EngineConfig(lora=("a=/a", "b=/b")), Metrics())
        await client._spawn()
        first = served(client.engine)
        for msg in (UnloadLora(0, "a"), UnloadLora(0, "b"), LoadLora(0, "b", "/b2"), LoadLora(0, "c", "/c")):
            await client.update_lora(msg)
        await client._spawn()  # the supervisor's, once the engine died
        return first, served(client.engine), client.engine.config.lora_enabled

    first, after, enabled = asyncio.run(scenario())
    assert first == {"a": "/a", "b": "/b"}
    assert after == {"b": "/b2", "c": "/c"} and enabled
