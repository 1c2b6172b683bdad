"""Data-parallel replicas behind one gateway (`--data-parallel-size 2`), on live servers with the served defaults:
greedy tokens identical to one engine under every routing policy, per-replica metrics, cache-aware routing finding
a conversation's prefix, a replica killed mid-load (its in-flight requests fail cleanly, no other request is
lost, new ones go to the survivor, and it comes back), and a replica that stops answering or dies before its requests'
first tokens (they move to the other replica, and their clients never know)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import parse_metrics
from test_hardening import cmdline, gateway_pid, metrics, sse_lines_to_events, wait_for_metrics

SHARED = (
    "You are a careful assistant for a shipping company. You answer questions about parcels, routes, "
    "delivery times, customs forms and lost items, briefly and politely, and you never invent tracking numbers. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    SHARED + "Question: how long does a parcel to Spain take?",
    "1, 2, 3, 4,",
    SHARED + "Question: what do I need for customs?",
    "The three primary colours are",
    "In 1969, the first person to walk on the Moon",
]
GREEDY = {"max_tokens": 16, "temperature": 0}


async def complete_all(url: str, prompts: list[str], **body) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as ac:

        async def one(p: str) -> dict:
            r = await ac.post("/v1/completions", json={"prompt": p, **GREEDY, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        return await asyncio.gather(*(one(p) for p in prompts))


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["orcinus_requests_running"] == m["orcinus_requests_waiting"] == m["orcinus_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "requests_" in k or "kv_blocks" in k}
        time.sleep(0.2)


def engines(url: str) -> list[int]:
    gateway = gateway_pid(url)
    children = Path(f"/proc/{gateway}/task/{gateway}/children").read_text().split()
    return sorted(int(c) for c in children if "engine.ipc.engine_loop" in cmdline(int(c)))


def series(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s series with these labels (in whatever order /metrics writes them)."""
    return sum(
        v
        for k, v in m.items()
        if k.startswith(name + "{") and all(f'{label}="{value}"' in k for label, value in labels.items())
    )


def healthy(m: dict[str, float]) -> dict[str, float]:
    return {i: m[f'orcinus_engine_healthy{{replica="{i}"}}'] for i in ("0", "1")}


@pytest.fixture(scope="module")
def round_robin_pair(server_factory):
    """Two replicas taking requests in turn: a stopped one gets its share until the gateway finds it out."""
    with server_factory("--data-parallel-size", "2", "--routing", "round-robin") as url:
        yield url


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    """Greedy tokens of one engine (the shared server), each prompt alone."""
    return [asyncio.run(complete_all(server, [p], logprobs=0))[0]["logprobs"]["tokens"] for p in PROMPTS]


def check_greedy_tokens_of_one_engine(url: str, reference: list[list[int]], finished_before: float = 0) -> None:
    assert len(engines(url)) == 2
    for _ in range(2):  # the second round finds the first's prefixes cached (on one replica or both)
        got = asyncio.run(complete_all(url, PROMPTS, logprobs=0))
        assert [c["logprobs"]["tokens"] for c in got] == reference
    m = wait_idle(url)
    # Each replica reports its own series; the requests were spread over both.
    iterations = [m[f'orcinus_iterations{{replica="{i}"}}'] for i in (0, 1)]
    assert all(n > 0 for n in iterations), iterations
    finished = sum(v for k, v in m.items() if k.startswith("orcinus_requests_finished_total"))
    assert finished - finished_before == 2 * len(PROMPTS)


# cache-aware, the default, is checked in the test after this one (a server start less).
def test_round_robin_gives_one_engine_s_greedy_tokens(round_robin_pair, reference):
    check_greedy_tokens_of_one_engine(round_robin_pair, reference)


def test_least_loaded_gives_one_engine_s_greedy_tokens(server_factory, reference):
    with server_factory("--data-parallel-size", "2", "--routing", "least-loaded") as url:
        check_greedy_tokens_of_one_engine(url, reference)


def test_a_stopped_replica_leaves_routing_and_its_requests_with_no_token_move(round_robin_pair, reference):
    url = round_robin_pair
    start = metrics(url)
    victim = engines(url)[0]
    os.kill(victim, signal.SIGSTOP)
    try:
        # Sent at once, half are routed to the stopped replica before the gateway finds it out: they move.
        first = asyncio.run(complete_all(url, PROMPTS[:4], logprobs=0))
        assert [c["logprobs"]["tokens"] for c in first] == reference[:4]
        m = wait_for_metrics(
            url, lambda m: sorted(healthy(m).values()) == [0.0, 1.0], 60, "the stopped replica out of routing"
        )
        [down] = [i for i, up in healthy(m).items() if not up]
        # Found out, it gets nothing more; the other serves everything.
        later = asyncio.run(complete_all(url, PROMPTS[4:], logprobs=0))
        assert [c["logprobs"]["tokens"] for c in later] == reference[4:]
        end = metrics(url)
        routed = series(end, "orcinus_routed_requests_total", replica=down) - series(
            start, "orcinus_routed_requests_total", replica=down
        )
        assert series(end, "orcinus_routed_requests_total", replica=down) == series(
            m, "orcinus_routed_requests_total", replica=down
        )
        moved = series(end, "orcinus_rerouted_requests_total", replica=down, reason="unresponsive") - series(
            start, "orcinus_rerouted_requests_total", replica=down, reason="unresponsive"
        )
        assert moved == routed, (moved, routed)  # each request it had got: none had a token
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    wait_for_metrics(url, lambda m: set(healthy(m).values()) == {1.0}, 60, "the replica back once it answers")
    wait_idle(url)


def test_requests_sent_to_a_replica_that_dies_before_their_first_token_go_to_the_other(round_robin_pair, reference):
    url = round_robin_pair
    start = metrics(url)
    victim = engines(url)[0]

    async def send_and_kill() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as ac:

            async def one(prompt: str) -> dict:
                r = await ac.post("/v1/completions", json={"prompt": prompt, **GREEDY, "logprobs": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            os.kill(victim, signal.SIGSTOP)  # what is sent to it now gets no token before it dies
            try:
                tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
                deadline = time.monotonic() + 60
                while True:  # every request sent to a replica (half of them to the stopped one), then it dies
                    m = parse_metrics((await ac.get("/metrics")).text)
                    routed = series(m, "orcinus_routed_requests_total") - series(start, "orcinus_routed_requests_total")
                    if routed >= len(PROMPTS):
                        break
                    assert time.monotonic() < deadline, routed
                    await asyncio.sleep(0.02)
            finally:
                os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    got = asyncio.run(send_and_kill())
    assert [c["logprobs"]["tokens"] for c in got] == reference
    m = wait_for_metrics(
        url, lambda m: m["orcinus_engine_restarts_total"] > start["orcinus_engine_restarts_total"], 60, "the death seen"
    )
    [dead] = [
        i
        for i in ("0", "1")
        if m[f'orcinus_engine_restarts_total{{replica="{i}"}}']
        > start[f'orcinus_engine_restarts_total{{replica="{i}"}}']
    ]
    routed = series(m, "orcinus_routed_requests_total", replica=dead) - series(
        start, "orcinus_routed_requests_total", replica=dead
    )
    moved = series(m, "orcinus_rerouted_requests_total", replica=dead) - series(
        start, "orcinus_rerouted_requests_total", replica=dead
    )
    assert moved == routed, (moved, routed)
    survivor = "1" if dead == "0" else "0"
    wait_for_metrics(url, lambda m: m[f'orcinus_kv_blocks_used{{replica="{survivor}"}}'] == 0, 60, "blocks freed")


def test_cache_aware_routing_follows_a_conversation_and_a_killed_replica_loses_only_its_own(server_factory, reference):
    with server_factory("--data-parallel-size", "2") as url:  # cache-aware is the default
        # A conversation's turns resend its history: every turn after the first goes where the history is cached,
        # whichever replica the first turn took.
        history = SHARED + "Customer: my parcel to Lisbon is late."
        for turn in range(4):
            before = metrics(url)
            [reply] = asyncio.run(complete_all(url, [history]))
            after = wait_idle(url)
            hits = [
                after[f'orcinus_prefix_cache_hit_tokens{{replica="{i}"}}']
                - before[f'orcinus_prefix_cache_hit_tokens{{replica="{i}"}}']
                for i in (0, 1)
            ]
            if turn:
                assert min(hits) == 0 and max(hits) >= 16 * ((len(history) // 8) // 16), (turn, hits)
            history += reply["text"] + f" Customer: and what about question {turn}?"
        routed = metrics(url)
        assert routed['orcinus_routed_requests_total{reason="cache"}'] == 3, {  # turns 2-4, summed over replicas
            k: v for k, v in routed.items() if k.startswith("orcinus_routed")
        }
        finished = sum(v for k, v in routed.items() if k.startswith("orcinus_requests_finished_total"))
        check_greedy_tokens_of_one_engine(url, reference, finished)

        # Kill one replica's engine while both serve long requests.
        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=300) as ac:

                async def streamed(i: int):
                    body = {
                        "prompt": f"Request {i}: tell me a long story.",
                        "max_tokens": 400,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    async with ac.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines()]

                tasks = [asyncio.create_task(streamed(i)) for i in range(8)]
                deadline = time.monotonic() + 120
                while True:
                    m = parse_metrics((await ac.get("/metrics")).text)
                    running = [m[f'orcinus_requests_running{{replica="{i}"}}'] for i in (0, 1)]
                    if sum(running) == len(tasks):
                        break
                    assert time.monotonic() < deadline, running
                    await asyncio.sleep(0.1)
                victim = engines(url)[0]
                os.kill(victim, signal.SIGKILL)
                # Once the gateway has seen it die, and while it restarts, new requests go to the survivor.
                while parse_metrics((await ac.get("/metrics")).text)["orcinus_engine_restarts_total"] < 1:
                    assert time.monotonic() < deadline + 30, "the replica's death went unnoticed"
                    await asyncio.sleep(0.05)
                during = await ac.post("/v1/completions", json={"prompt": PROMPTS[0], **GREEDY})
                health = (await ac.get("/health")).status_code
                return victim, running, await asyncio.gather(*tasks), during, health

        victim, running, streams, during, health = asyncio.run(load())
        failed, finished = [], []
        for lines in streams:
            events, done = sse_lines_to_events(lines)
            assert done, "a stream did not end with [DONE]"
            if "error" in events[-1]:
                assert events[-1]["error"]["type"] == "service_unavailable_error", events[-1]
                failed.append(events)
            else:
                assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 0
                assert events[-1]["choices"][0]["finish_reason"] == "length"
                finished.append(events)
        # Exactly the dead replica's requests failed; the survivor's all finished.
        assert len(failed) in running and len(failed) + len(finished) == 8 and failed and finished, running
        assert during.status_code == 200, during.text
        assert health == 200  # the other replica serves: the server is up
        deadline = time.monotonic() + 180
        while len(engines(url)) < 2 or metrics(url)["orcinus_engine_restarts_total"] < 1:
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.25)
        assert victim not in engines(url)
        wait_idle(url)
