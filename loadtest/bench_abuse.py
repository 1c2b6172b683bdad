"""Abuse beside an honest client (issue 27): what a large schema, a slowloris and never-read streams cost others.

One server (started here on loopback, or --base-url). A victim streams completions one after another the whole
time, and a prober asks /health every 50 ms; each phase records the victim's inter-token gaps (client-side arrival
of its SSE chunks) and /health's latency:

- quiet: nothing else.
- schema: --schemas chat requests at once, each with its own ~0.4 MB JSON schema (a distinct one each: no cache).
- slowloris: --slowloris connections (another process) that each send a partial request head and a byte every
  second, reconnecting whenever the server closes one.
- never-read: 8 chat streams with n=16 (and 20 top logprobs, so that they outgrow the socket buffers) whose sockets
  are never read; once the engine has finished or dropped them, another client sends a request every 0.5 s for
  --after seconds: any 429 is a slot the unread streams still hold.

Goals: the victim's p99 gap within 1.5x of quiet, /health under 100 ms throughout, no 429 for the other client
(while the unread streams run or after).

    python loadtest/bench_abuse.py --out benchmarks/abuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_server import launch_server, stop_server


def big_schema(seed: int, target_bytes: int) -> dict:
    """About `target_bytes` of JSON schema, its names unique to `seed`: an object of groups of 40 required fields
    (a flat object of thousands of optional ones is past llguidance's limit on alternatives, and fails)."""
    groups, size, g = {}, 0, 0
    while size < target_bytes:
        fields = {f"s{seed}_g{g}_f{i}": {"type": "string", "maxLength": 20} if i % 2 else
                  {"type": "integer", "minimum": 0, "maximum": 999} for i in range(40)}
        group = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
        groups[f"s{seed}_group_{g}"] = group
        size += len(json.dumps(group))
        g += 1
    return {"type": "object", "properties": groups, "required": list(groups), "additionalProperties": False}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Observer:
    """The victim's stream and the /health prober, recording into the current phase."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.gaps: list[float] = []
        self.health: list[float] = []
        self.health_errors = 0
        self.running = True

    def take(self) -> tuple[list[float], list[float], int]:
        out = (self.gaps, self.health, self.health_errors)
        self.gaps, self.health, self.health_errors = [], [], 0
        return out

    async def victim(self) -> None:
        body = {"prompt": "Tell me a long story about the sea.", "max_tokens": self.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as client:
            while self.running:
                last = None
                async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now

    async def prober(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while self.running:
                t = time.perf_counter()
                try:
                    ok = (await client.get(f"{self.url}/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append(time.perf_counter() - t)
                self.health_errors += not ok
                await asyncio.sleep(0.05)


def summary(name: str, gaps: list[float], health: list[float], errors: int, **extra) -> dict:
    row = {"phase": name, "gaps": len(gaps), "itl_p50_ms": _ms(percentile(gaps, 0.5)),
           "itl_p99_ms": _ms(percentile(gaps, 0.99)), "itl_max_ms": _ms(max(gaps, default=None)),
           "health_probes": len(health), "health_p99_ms": _ms(percentile(health, 0.99)),
           "health_max_ms": _ms(max(health, default=None)), "health_errors": errors, **extra}
    print(json.dumps(row), flush=True)
    return row


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


# ---------------------------------------------------------------- slowloris (its own process)


def slowloris(url: str, count: int, seconds: float, result) -> None:
    asyncio.run(_slowloris(url, count, seconds, result))


async def _slowloris(url: str, count: int, seconds: float, result) -> None:
    host, port = "127.0.0.1", urlparse(url).port
    end = time.monotonic() + seconds
    stats = {"opened": 0, "closed_by_server": 0, "got_408": 0, "refused_503": 0, "connect_errors": 0}

    # Each connection: a partial head, then one byte a second until the server answers or closes.
    async def loris() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                stats["connect_errors"] += 1
                await asyncio.sleep(1)
                continue
            stats["opened"] += 1
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            data = b""
            while time.monotonic() < end:
                try:
                    data = await asyncio.wait_for(reader.read(4096), 1.0)
                    break  # an answer (408 or 503) or the end of the connection
                except asyncio.TimeoutError:
                    try:
                        writer.write(b"x")
                        await writer.drain()
                    except OSError:
                        break
                except OSError:
                    break
            if time.monotonic() < end:
                stats["closed_by_server"] += 1
                stats["got_408"] += data.startswith(b"HTTP/1.1 408")
                stats["refused_503"] += data.startswith(b"HTTP/1.1 503")
            writer.close()

    await asyncio.gather(*(loris() for _ in range(count)))
    result.update(stats)


# ---------------------------------------------------------------- never-read streams


def unread_stream(url: str, body: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up
    sock.connect(("127.0.0.1", urlparse(url).port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def others(url: str, seconds: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(timeout=900) as client:  # one admitted behind 128 sequences waits its turn
        async def one():
            r = await client.post(f"{url}/v1/completions", json=body)
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1

        tasks, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
    return counts


# ---------------------------------------------------------------- the run


async def quiet(args, url: str, obs: Observer) -> dict:
    await asyncio.sleep(args.quiet)
    return summary("quiet", *obs.take())


async def schema(args, url: str, obs: Observer) -> dict:
    schemas = [big_schema(1000 + i, args.schema_bytes) for i in range(args.schemas)]
    async with httpx.AsyncClient(timeout=600) as client:
        async def constrained(schema):
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Fill in the form."}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}})
            return r.status_code, time.perf_counter() - t

        t = time.perf_counter()
        results = await asyncio.gather(*(constrained(s) for s in schemas))
        await asyncio.sleep(max(0.0, args.quiet - (time.perf_counter() - t)))  # as many gaps as quiet
    return summary("schema", *obs.take(), schema_bytes=[len(json.dumps(s)) for s in schemas],
                   statuses=[s for s, _ in results], request_seconds=[round(x, 2) for _, x in results])


async def slowloris_phase(args, url: str, obs: Observer) -> dict:
    result = multiprocessing.Manager().dict()
    loris = multiprocessing.Process(target=slowloris, args=(url, args.slowloris, args.slowloris_seconds, result))
    loris.start()
    while loris.is_alive():
        await asyncio.sleep(0.5)
    return summary("slowloris", *obs.take(), connections=args.slowloris, **dict(result))


OBSERVED = {"quiet": quiet, "schema": schema, "slowloris": slowloris_phase}


async def never_read(args, url: str) -> dict:
    before = metrics(url)
    # 20 top logprobs make each chunk ~4 KB, so a stream outgrows loopback's socket buffers (a few MB) and the
    # server's writes really stall; without them the whole stream fits there and nothing is left unsent.
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                       "max_tokens": args.unread_tokens, "n": 16, "stream": True, "ignore_eos": True,
                       "temperature": 0.8, "logprobs": True, "top_logprobs": 20}).encode()
    socks = [unread_stream(url, body) for _ in range(8)]
    t = time.perf_counter()
    while metrics(url)["orcinus_sequences_admitted"] < 8 * 16:
        await asyncio.sleep(0.1)
    during = await others(url, 2.0)  # the admission queues them (issue 29): no 429 even now
    while True:
        m = metrics(url)
        if m["orcinus_requests_running"] == m["orcinus_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.5)
    engine_done = time.perf_counter() - t
    admitted_after = m["orcinus_sequences_admitted"]
    read_tokens = m["orcinus_generation_tokens_total"] - before["orcinus_generation_tokens_total"]
    after = await others(url, args.after)
    m = metrics(url)
    for sock in socks:
        sock.close()
    row = {"phase": "never-read", "streams": 8, "n": 16, "max_tokens": args.unread_tokens,
           "engine_done_seconds": round(engine_done, 1), "statuses_while_running": during,
           "sequences_admitted_when_engine_done": admitted_after,
           "tokens_turned_into_chunks": read_tokens, "tokens_generated": 8 * 16 * args.unread_tokens,
           "statuses_after_engine_done": after,
           "aborted_by_send_timeout": m["orcinus_requests_aborted_total"] - before["orcinus_requests_aborted_total"]}
    print(json.dumps(row), flush=True)
    return row


async def run(args, url: str) -> list[dict]:
    rows = []
    observed = [p for p in args.phases if p in OBSERVED]
    if observed:
        obs = Observer(url, args.victim_tokens)
        tasks = [asyncio.create_task(obs.victim()), asyncio.create_task(obs.prober())]
        try:
            deadline = time.monotonic() + 600  # warm-up: a fresh server may build its CPU ops on the first request
            while len(obs.gaps) < 50 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            obs.take()
            for phase in observed:
                rows.append(await OBSERVED[phase](args, url, obs))
        finally:
            obs.running = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if "never-read" in args.phases:
        rows.append(await never_read(args, url))
    return rows


def verdict(rows: list[dict]) -> dict:
    by = {row["phase"]: row for row in rows}
    out = {}
    for name in ("schema", "slowloris"):
        if name in by and "quiet" in by:
            row, quiet_p99 = by[name], by["quiet"]["itl_p99_ms"]
            if row["itl_p99_ms"] and quiet_p99:
                out[name] = {"itl_p99_over_quiet": round(row["itl_p99_ms"] / quiet_p99, 2),
                             "itl_within_1_5x": row["itl_p99_ms"] <= 1.5 * quiet_p99}
    for name in OBSERVED:
        if name in by:
            row = by[name]
            out.setdefault(name, {})["health_under_100ms"] = row["health_max_ms"] < 100 and row["health_errors"] == 0
    if "never-read" in by:
        row = by["never-read"]
        out["never-read"] = {"no_429_while_running": "429" not in row["statuses_while_running"],
                             "no_429_after_engine_done": "429" not in row["statuses_after_engine_done"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    ap.add_argument("--quiet", type=float, default=20.0, help="seconds of the quiet phase")
    ap.add_argument("--schemas", type=int, default=3)
    ap.add_argument("--schema-bytes", type=int, default=400_000)
    ap.add_argument("--slowloris", type=int, default=1000, help="connections")
    ap.add_argument("--slowloris-seconds", type=float, default=30.0)
    ap.add_argument("--victim-tokens", type=int, default=64)
    ap.add_argument("--unread-tokens", type=int, default=300)
    ap.add_argument("--after", type=float, default=20.0, help="seconds of requests after the engine is done")
    ap.add_argument("--phases", nargs="+", default=[*OBSERVED, "never-read"], choices=[*OBSERVED, "never-read"])
    ap.add_argument("--server-flags", default="", help="more `orcinus serve` flags, e.g. '--num-threads 1'")
    ap.add_argument("--server-log", default=None, help="write the server's log here")
    ap.add_argument("--note", default="", help="recorded with the result (e.g. what else loaded the machine)")
    ap.add_argument("--out", default="benchmarks/abuse.json")
    args = ap.parse_args()
    proc, url = None, args.base_url
    if url is None:
        log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
        proc, url = launch_server(shlex.split(args.server_flags), log=log, timeout=300)
    try:
        rows = asyncio.run(run(args, url))
    finally:
        leaked = stop_server(proc) if proc is not None else []
    result = {"command": "python loadtest/bench_abuse.py " + shlex.join(sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_at_end": os.getloadavg()},
              "note": args.note, "config": vars(args), "phases": rows, "verdict": verdict(rows),
              "leaked_shm": leaked}
    print(json.dumps(result["verdict"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
