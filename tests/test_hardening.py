"""Hardening against live servers: admission control under 10x overload, a storm of disconnecting streams,
kill -9 of the engine mid-load (in-flight requests fail at once, a new engine takes over, no stale shared
memory), and SIGTERM (in-flight requests finish, then the process exits clean). Servers come from the
`server_factory` fixture of conftest.py, which also checks on exit that no /dev/shm segment of theirs is left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from conftest import free_port, parse_metrics, start_server, unlinked_rings
from conftest import wait_for_metrics as wait_for_server_metrics

PROMPT = "The capital of France is"
# One torch thread per engine: on this 2-core machine an engine with two threads slows down 10x or more
# whenever another busy process shares the cores (its OpenMP threads spin), and the tests here must not.
ONE_THREAD = ("--num-threads", "1")
LONG_PROMPTS = [
    "Write a long story about a dragon.",
    "List every animal you know.",
    "Explain how ships float.",
    "Describe a walk through a forest.",
    "Tell me about the history of bread.",
]


# ---------------------------------------------------------------- helpers


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def wait_for_metrics(url: str, pred, timeout: float, what: str) -> dict[str, float]:
    return wait_for_server_metrics(lambda: metrics(url), pred, timeout, what)


def idle(m: dict[str, float]) -> bool:
    return (
        m["orcinus_requests_running"]
        == m["orcinus_requests_waiting"]
        == m["orcinus_kv_blocks_used"]
        == m["orcinus_sequences_in_flight"]
        == 0
    )


def sse_lines_to_events(lines: list[str]) -> tuple[list[dict], bool]:
    """The JSON events of an SSE stream, and whether `data: [DONE]` ended it."""
    events, done = [], False
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            assert not done, f"data after [DONE]: {line!r}"
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
    return events, done


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def gateway_pid(url: str) -> int:
    """The `orcinus serve` process listening on `url`'s port."""
    port = str(urlparse(url).port)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                args = cmdline(int(proc.name))
            except OSError:
                continue
            if "gateway.cli" in args and "serve" in args and args[args.index("--port") + 1] == port:
                return int(proc.name)
    raise AssertionError(f"no server process on port {port}")


def engine_pid(gateway: int) -> int:
    children = Path(f"/proc/{gateway}/task/{gateway}/children").read_text().split()
    engines = [int(c) for c in children if "engine.ipc.engine_loop" in cmdline(int(c))]
    assert len(engines) == 1, f"expected one engine process among {children}"
    return engines[0]


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(pid: int, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while running(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def rings_of(gateway: int) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"orcinus_{gateway}_*")}


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_openai_error(status: int, headers, body: dict, expect_status: int, type_: str) -> None:
    assert status == expect_status, body
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == type_ and body["error"]["message"], body


# ---------------------------------------------------------------- admission control


@pytest.fixture(scope="module")
def small_server(server_factory):
    """Room for 2 running and 4 waiting sequences."""
    with server_factory("--max-num-seqs", "2", "--max-waiting", "4", *ONE_THREAD) as url:
        yield url


def test_overload_refuses_the_excess_at_once_and_serves_every_admitted_request(small_server):
    url, clients = small_server, 60  # 10x the queue
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    reference = complete(url, **body)["choices"][0]["text"]
    before = wait_for_metrics(url, idle, 30, "the server did not go idle")

    async def run():
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as ac:
            samples, stop = [], asyncio.Event()

            async def sample():
                while not stop.is_set():
                    samples.append(parse_metrics((await ac.get("/metrics")).text))
                    await asyncio.sleep(0.05)

            async def one(i: int):
                if i % 2:  # half of them stream
                    async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        if r.status_code != 200:
                            return r.status_code, r.headers, json.loads(await r.aread()), time.monotonic()
                        lines = [line async for line in r.aiter_lines()]
                        return 200, r.headers, lines, time.monotonic()
                r = await ac.post("/v1/completions", json=body)
                return r.status_code, r.headers, r.json(), time.monotonic()

            sampler = asyncio.create_task(sample())
            results = await asyncio.gather(*(one(i) for i in range(clients)))
            stop.set()
            await sampler
            return results, samples

    results, samples = asyncio.run(run())
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(admitted) + len(refused) == clients, sorted({r[0] for r in results})
    assert len(admitted) >= 6 and len(refused) >= clients // 2, (len(admitted), len(refused))
    for status, headers, payload, _ in refused:
        assert_openai_error(status, headers, payload, 429, "rate_limit_error")
        assert payload["error"]["code"] == "rate_limit_exceeded"
        assert int(headers["retry-after"]) >= 1
    for _, _, payload, _ in admitted:
        if isinstance(payload, list):
            events, done = sse_lines_to_events(payload)
            assert done and all("error" not in e for e in events), events
            assert "".join(c["text"] for e in events for c in e["choices"]) == reference
        else:
            assert payload["choices"][0]["text"] == reference
    # Refusals did not wait for capacity: every one came back while admitted requests were still running.
    assert max(r[3] for r in refused) < max(r[3] for r in admitted)
    # The bound held throughout: never more than 2 running, 4 queued, 6 admitted.
    assert max(s["orcinus_requests_running"] for s in samples) <= 2
    assert max(s["orcinus_requests_waiting"] for s in samples) <= 4
    assert max(s["orcinus_sequences_in_flight"] for s in samples) <= 6
    after = wait_for_metrics(url, idle, 30, "the server did not go idle")
    assert after["orcinus_requests_rejected_total"] - before["orcinus_requests_rejected_total"] == len(refused)
    # Memory stayed bounded: a refused request leaves nothing behind.
    assert after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"] < 64 * 2**20
    assert after["orcinus_engine_resident_memory_bytes"] - before["orcinus_engine_resident_memory_bytes"] < 256 * 2**20
    assert complete(url, **body)["choices"][0]["text"] == reference


def test_a_request_larger_than_the_whole_capacity_is_a_400_not_a_429(small_server):
    r = httpx.post(f"{small_server}/v1/completions", json={"prompt": PROMPT, "n": 7, "max_tokens": 2}, timeout=60)
    assert_openai_error(r.status_code, r.headers, r.json(), 400, "invalid_request_error")
    assert r.json()["error"]["param"] == "n"


# ---------------------------------------------------------------- disconnects and a dying engine


@pytest.fixture(scope="module")
def roomy_server(server_factory):
    """Room for 64 running and 256 waiting sequences: a storm of 200 streams is all admitted."""
    with server_factory("--max-waiting", "256", *ONE_THREAD) as url:
        yield url


def test_disconnect_storm_frees_every_kv_block(roomy_server):
    url, clients = roomy_server, 200
    rng = random.Random(8)
    plans = [
        (rng.choice(LONG_PROMPTS), rng.choice(["events", "timer"]), rng.randint(0, 12), rng.uniform(0, 3))
        for _ in range(clients)
    ]

    async def one(ac: httpx.AsyncClient, prompt: str, mode: str, events: int, seconds: float) -> tuple[int, int]:
        """Leave after `events` events, or after `seconds` whatever the stream is doing (even before headers)."""
        seen, status = 0, None

        async def read():
            nonlocal seen, status
            body = {"prompt": prompt, "max_tokens": 64, "temperature": 0.8, "ignore_eos": True, "stream": True}
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        seen += 1
                        if mode == "events" and seen > events:
                            return  # closing the response drops the connection mid-stream

        try:
            await asyncio.wait_for(read(), seconds if mode == "timer" else 120)
        except TimeoutError:
            pass
        return status, seen

    async def run():
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as ac:
            return await asyncio.gather(*(one(ac, *plan) for plan in plans))

    results = asyncio.run(run())
    assert {status for status, _ in results} <= {200, None}, results  # nobody refused: all fit
    left_mid_stream = sum(1 for status, seen in results if status == 200 and 0 < seen < 65)
    left_early = sum(1 for status, seen in results if seen == 0)
    assert left_mid_stream > 50 and left_early > 5, (left_mid_stream, left_early)
    m = wait_for_metrics(url, idle, 60, "KV blocks or admissions were still held after every client left")
    assert m["orcinus_kv_blocks_free"] > 0
    r = complete(url, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r["choices"][0]["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] >= 1


def test_kill_9_of_the_engine_fails_in_flight_requests_at_once_and_a_new_engine_takes_over(roomy_server):
    url = roomy_server
    reference = complete(url, prompt=PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    gateway = gateway_pid(url)
    old_engine = engine_pid(gateway)
    spec = json.loads(cmdline(old_engine)[-1])
    old_rings = {spec["to_engine"]["shm_name"], spec["from_engine"]["shm_name"]}
    old_bells = [Path(spec[side]["doorbell_path"]) for side in ("to_engine", "from_engine")]
    # Mapped by the engine, their names already unlinked: a dead process cannot leave them behind.
    assert unlinked_rings(old_engine) == old_rings and not rings_of(gateway)
    assert not any(b.exists() or b.parent.exists() for b in old_bells)
    restarts = metrics(url)["orcinus_engine_restarts_total"]
    long = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:

            async def streamed(prompt: str):
                async with ac.stream("POST", "/v1/completions", json={"prompt": prompt, **long, "stream": True}) as r:
                    assert r.status_code == 200
                    lines, ended = [], None
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line.startswith("data:") and '"error"' in line:
                            ended = time.monotonic()
                    return lines, ended

            async def plain(prompt: str):
                r = await ac.post("/v1/completions", json={"prompt": prompt, **long})
                return r, time.monotonic()

            tasks = [asyncio.create_task(streamed(p)) for p in LONG_PROMPTS]
            tasks += [asyncio.create_task(plain(p)) for p in LONG_PROMPTS]
            deadline = time.monotonic() + 60
            while parse_metrics((await ac.get("/metrics")).text)["orcinus_requests_running"] < len(tasks):
                assert time.monotonic() < deadline, "the requests never all ran"
                await asyncio.sleep(0.1)
            killed_at = time.monotonic()
            os.kill(old_engine, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            health = (await ac.get("/health")).status_code
            return killed_at, results, health

    killed_at, results, health = asyncio.run(run())
    # The issue asks for 1 s; this measures client-side on a shared 2-core machine, hence the slack.
    for lines, ended in results[: len(LONG_PROMPTS)]:
        events, done = sse_lines_to_events(lines)
        assert done, "the stream did not end with [DONE] after the error"
        assert events[-1]["error"]["type"] == "service_unavailable_error", events[-1]
        assert ended - killed_at < 1.5, ended - killed_at
    for r, ended in results[len(LONG_PROMPTS) :]:
        assert_openai_error(r.status_code, r.headers, r.json(), 503, "service_unavailable_error")
        assert ended - killed_at < 1.5, ended - killed_at
    assert health == 503  # the new engine is still loading

    wait_for_metrics(url, lambda m: m["orcinus_engine_restarts_total"] == restarts + 1, 10, "no restart counted")
    deadline = time.monotonic() + 180
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.25)
    new_engine = engine_pid(gateway)
    assert new_engine != old_engine
    # The new engine has fresh rings, unlinked once it attached; nothing of the dead one's is left.
    new_rings = unlinked_rings(new_engine)
    assert len(new_rings) == 2 and not new_rings & old_rings and not rings_of(gateway), (new_rings, old_rings)
    assert complete(url, prompt=PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == reference
    wait_for_metrics(url, idle, 30, "the new engine did not go idle")


def test_kill_9_of_the_gateway_leaves_no_ring_or_doorbell_and_its_engine_exits(tmp_path):
    """The OOM killer or `docker kill` gives no chance to clean up: nothing in /dev/shm or /tmp may depend on it."""
    gateway, url, _ = start_server(tmp_path, *ONE_THREAD)
    try:
        engine = engine_pid(gateway.pid)
        spec = json.loads(cmdline(engine)[-1])
        bells = [Path(spec[side]["doorbell_path"]).parent for side in ("to_engine", "from_engine")]
        assert complete(url, prompt=PROMPT, max_tokens=4, temperature=0)["usage"]["completion_tokens"] == 4
    finally:
        gateway.kill()
        gateway.wait()
    assert gateway.returncode == -signal.SIGKILL
    wait_until_gone(engine, "the engine outlived its gateway")  # it notices it was orphaned
    assert not rings_of(gateway.pid) and not any(b.exists() for b in bells)


def model_that_never_loads(tmp_path: Path) -> Path:
    """A checkpoint directory whose config.json is a FIFO nobody writes: an engine's load waits on it for ever."""
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    return model


def wait_until_it_loads(model: Path, alive) -> int:
    """Block until something has the model's config.json open (the engine is reading the model); returns our end
    of the FIFO, to close at the end. `alive()` false, or two minutes, fails the test."""
    deadline = time.monotonic() + 120
    while True:
        assert alive() and time.monotonic() < deadline, "the engine never began to load the model"
        with contextlib.suppress(OSError):  # ENXIO: no reader yet
            return os.open(model / "config.json", os.O_WRONLY | os.O_NONBLOCK)
        time.sleep(0.05)


def clean_up_launch(gateway: subprocess.Popen, engine: int, writer: int | None, bells: list[Path]) -> None:
    """Whatever a launch test left: the processes, the FIFO's end, the rings and doorbells never unlinked."""
    gateway.kill()
    if running(engine):
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
    if writer is not None:
        os.close(writer)
    for ring in rings_of(gateway.pid):
        (Path("/dev/shm") / ring).unlink(missing_ok=True)
    for bell in bells:
        shutil.rmtree(bell, ignore_errors=True)


GATEWAY_LAUNCHING = """import os, signal, sys, time
from engine.core.config import EngineConfig
from gateway.engines.process import EngineProcess
engine = EngineProcess(EngineConfig(model=sys.argv[1], num_threads=1), lambda frame: None)
engine.launch()
if sys.argv[2] == "stopped":  # held before its first line of Python: it will look for its gateway too late
    os.kill(engine.pid, signal.SIGSTOP)
    # And its rings outlive this process, as when the engine attaches before this one's resource tracker, which
    # unlinks them once it is gone, has got to them (else the engine fails to attach, and exits all the same).
    from multiprocessing import resource_tracker
    for channel in (engine.to_engine, engine.from_engine):
        resource_tracker.unregister("/" + channel.handle().shm_name, "shared_memory")
print(engine.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("when", ["while_it_loads", "before_it_looks"])
def test_kill_9_of_the_gateway_during_the_engine_s_start_ends_the_engine_too(tmp_path, when):
    """Before, the engine looked for its gateway only once loaded: a load that lasts (or waits on something that
    never comes, as this one's config.json, a FIFO nobody writes) kept it alive for as long, its gateway long gone. And
    a gateway dead before the engine first asked for its parent passed for alive: the engine took init for it."""
    model = model_that_never_loads(tmp_path)
    gateway = subprocess.Popen(
        [sys.executable, "-c", GATEWAY_LAUNCHING, str(model), "stopped" if when == "before_it_looks" else "running"],
        stdout=subprocess.PIPE,
        text=True,
    )
    engine, writer = int(gateway.stdout.readline()), None
    spec = json.loads(cmdline(engine)[-1])
    bells = [Path(spec[side]["doorbell_path"]).parent for side in ("to_engine", "from_engine")]
    try:
        if when == "while_it_loads":
            writer = wait_until_it_loads(model, lambda: running(engine))
        gateway.kill()
        gateway.wait()
        os.kill(engine, signal.SIGCONT)
        wait_until_gone(engine, "the engine outlived its gateway")
    finally:
        # Its rings were never unlinked: the gateway does that once the engine is up.
        clean_up_launch(gateway, engine, writer, bells)


GATEWAY_READING = """import asyncio, sys
from engine.core.config import EngineConfig
from gateway.engines.process import EngineProcess
async def main():
    engine = EngineProcess(EngineConfig(model=sys.argv[1], num_threads=1), lambda frame: None)
    await engine.start()
    print(engine.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_a_gateway_killed_while_its_engine_loads_leaves_no_doorbell(tmp_path):
    """The gateway removes the channels' names once the engine has opened them, which must not wait for the model's
    load (minutes for a large one): killed during it, the gateway left both doorbells in /tmp."""
    model = model_that_never_loads(tmp_path)
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY_READING, str(model)], stdout=subprocess.PIPE, text=True)
    engine, writer = int(gateway.stdout.readline()), None
    spec = json.loads(cmdline(engine)[-1])
    bells = [Path(spec[side]["doorbell_path"]).parent for side in ("to_engine", "from_engine")]
    try:
        writer = wait_until_it_loads(model, lambda: running(engine))
        deadline = time.monotonic() + 30
        while rings_of(gateway.pid) or any(b.exists() for b in bells):
            assert time.monotonic() < deadline, (
                f"the channels' names outlast the engine's attach: {rings_of(gateway.pid)}"
            )
            time.sleep(0.05)
        gateway.kill()
        gateway.wait()
        wait_until_gone(engine, "the engine outlived its gateway")
    finally:
        clean_up_launch(gateway, engine, writer, bells)


# ---------------------------------------------------------------- start-up that cannot begin or is stopped


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", *args], capture_output=True, text=True, timeout=120
    )


def test_a_model_that_is_not_there_stops_the_start_with_one_line():
    done = serve("--model", "/nonexistent/model.gguf", "--port", str(free_port()))
    message = (
        "no model at '/nonexistent/model.gguf': expected a .gguf file, a checkpoint directory (with config.json) or "
        "dummy:NAME"
    )
    assert (done.returncode, done.stderr) == (1, f"orcinus serve: {message}\n")


def test_a_model_the_engine_cannot_load_ends_the_start_with_its_reason(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NopeForCausalLM"], "model_type": "nope"}')
    done = serve("--model", str(tmp_path), "--port", str(free_port()))
    assert done.returncode == 3  # uvicorn's start-up failure
    log = done.stdout + done.stderr
    assert "ValueError: unsupported model_type 'nope'" in log  # the engine's reason, in the server's log
    assert "the engine process exited while loading the model (code 1)" in log
    assert "Exception ignored" not in log, log  # the engine left without its teardown's noise


def test_an_adapter_named_as_the_served_model_stops_the_start(tmp_path):
    done = serve("--lora", f"SmolLM2-135M-Instruct={tmp_path}", "--port", str(free_port()))
    assert (done.returncode, done.stderr) == (
        1,
        "orcinus serve: --lora SmolLM2-135M-Instruct=...: an adapter may not take the served model's name\n",
    )


def test_a_port_in_use_stops_the_start_before_any_engine_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--port", str(port))
    assert (done.returncode, done.stderr) == (
        1,
        f"orcinus serve: cannot listen on http://127.0.0.1:{port}: Address already in use\n",
    )
    assert "Started server process" not in done.stdout + done.stderr  # uvicorn never ran, nor any engine


def test_ctrl_c_during_the_model_s_load_stops_the_server_at_once(tmp_path):
    """A load can take minutes: SIGINT during it must end the engine and the server then, with status 0 (it was
    ignored until the load ended). The model's config.json is a FIFO, so the load waits as long as the test needs."""
    model = model_that_never_loads(tmp_path)
    log, writer = tmp_path / "server.log", None
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model), "--port", str(free_port())],
            stdout=out,
            stderr=out,
        )
    try:
        writer = wait_until_it_loads(model, lambda: server.poll() is None)
        deadline = time.monotonic() + 60
        while "Waiting for application startup" not in log.read_text():  # uvicorn's handlers are in place
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        engine = engine_pid(server.pid)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0, log.read_text()
        assert not running(engine), "the engine outlived the server"
    finally:
        server.kill()
        if writer is not None:
            os.close(writer)
    text = log.read_text()
    assert "stopped while the engine was loading" in text and "Traceback" not in text, text


# ---------------------------------------------------------------- graceful shutdown


async def stream_and_whole_running(ac: httpx.AsyncClient, body: dict) -> list[asyncio.Task]:
    """Start one streamed and one whole completion of `body`; return their tasks once both are running."""

    async def streamed():
        async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return r.status_code, [line async for line in r.aiter_lines()]

    tasks = [asyncio.create_task(streamed()), asyncio.create_task(ac.post("/v1/completions", json=body))]
    deadline = time.monotonic() + 60
    while parse_metrics((await ac.get("/metrics")).text)["orcinus_requests_running"] < 2:
        assert time.monotonic() < deadline, "the requests never ran"
        await asyncio.sleep(0.05)
    return tasks


SERVING_A_BARE_APP = """import sys, types
from starlette.applications import Starlette
from gateway.cli import run_server
app = Starlette()
app.state.orcinus = types.SimpleNamespace(begin_shutdown=lambda: None)
run_server(app, host="127.0.0.1", port=int(sys.argv[1]), shutdown_timeout=5)
"""


def test_ctrl_c_stops_the_server_without_a_traceback(tmp_path):
    """uvicorn raises the SIGINT it handled again once it has shut down; the server must end there, with status 0 and
    its log free of a KeyboardInterrupt traceback (uvicorn.run swallows it the same way)."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-c", SERVING_A_BARE_APP, str(port)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while "Uvicorn running" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, log.read_text()
    finally:
        server.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_sigterm_lets_in_flight_requests_finish_then_exits_clean(server_factory):
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    # Leaving this block runs conftest's checks: exit code, no /dev/shm segment of ours, no child outlives it.
    with server_factory(*ONE_THREAD) as url:
        reference = complete(url, **body)["choices"][0]["text"]
        gateway = gateway_pid(url)

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
                tasks = await stream_and_whole_running(ac, body)
                deadline = time.monotonic() + 60
                os.kill(gateway, signal.SIGTERM)
                refused = False
                while not refused and time.monotonic() < deadline:  # it stops accepting new connections
                    try:
                        async with httpx.AsyncClient(timeout=5) as fresh:
                            await fresh.get(f"{url}/health")
                        await asyncio.sleep(0.05)
                    except httpx.RemoteProtocolError:
                        pass  # accepted as the listener closed, then closed unanswered: the next try tells
                    except httpx.ConnectError:
                        refused = True
                return refused, await asyncio.gather(*tasks)

        refused, ((status, lines), plain) = asyncio.run(run())
        assert refused, "the server still accepted connections after SIGTERM"
        assert status == 200
        events, done = sse_lines_to_events(lines)
        assert done and "".join(c["text"] for e in events for c in e["choices"]) == reference
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == reference
        deadline = time.monotonic() + 60
        while running(gateway):
            assert time.monotonic() < deadline, "the server did not exit after its requests finished"
            time.sleep(0.1)


def test_a_stream_still_running_at_the_shutdown_timeout_ends_with_an_error_event_and_done(server_factory):
    """SIGTERM with --shutdown-timeout 3 and a stream that needs a minute: just before the timeout the stream
    gets an error event then `data: [DONE]` (not a cut connection), and a whole response a 503."""
    long = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with server_factory(*ONE_THREAD, "--shutdown-timeout", "3", "--max-model-len", "4200") as url:
        gateway = gateway_pid(url)

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
                tasks = await stream_and_whole_running(ac, long)
                started = time.monotonic()
                os.kill(gateway, signal.SIGTERM)
                results = await asyncio.gather(*tasks)
                return time.monotonic() - started, results

        waited, ((status, lines), plain) = asyncio.run(run())
        assert status == 200
        events, done = sse_lines_to_events(lines)
        assert done, "the stream was cut without [DONE]"
        assert "choices" in events[0] and events[-1]["error"]["code"] == "service_unavailable"
        assert "shutting down" in events[-1]["error"]["message"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "service_unavailable"
        assert waited < 30, waited
