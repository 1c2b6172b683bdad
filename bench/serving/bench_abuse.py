"""Abuse beside an honest client (issue 27): what a large schema, a slowloris and never-read streams cost others.

    python -m bench.serving.bench_abuse         # ~8 min on 2 cores; writes benchmarks/results/serving/abuse.json
    python -m bench.serving.bench_abuse --rounds 1 --quiet 10 --slowloris-seconds 15 --out /tmp/abuse.json  # quick

One server (started here on loopback with two API keys, or --base-url with --keys). A victim streams completions
one after another the whole time, and a prober asks /health every 50 ms; each phase records the victim's
inter-token gaps (client-side arrival of its SSE chunks) and /health's latency. The observed phases run --rounds
times, their order rotated each round, and each abuse is compared with the quiet phase of its own round, so that a
burst of load from elsewhere on the machine moves one round, not the verdict (the median over rounds):

- quiet: nothing else.
- schema: --schemas chat requests at once, each with its own ~0.4 MB JSON schema (a distinct one each: no cache);
  the row also gives the gaps that arrived while they were in flight (`burst_*`), the rest of the phase is quiet.
- slowloris: --slowloris connections (another process) that each send a partial request head and a byte every
  second, reconnecting whenever the server closes one.
- never-read: 8 chat streams with n=16 (and 20 top logprobs, so that they outgrow the socket buffers) whose sockets
  are never read; once the engine has finished or dropped them, another client sends a request every 0.5 s for
  --after seconds: any 429 is a slot the unread streams still hold.
- cache-timing (once, needs two keys): per round a fresh ~500-token prompt, sent by key A (cold), then by key B,
  then by A again; their latencies and prefix-cache hit tokens. B's should look like A's cold one, not the warm one.

Goals: the victim's p99 gap within 1.5x of quiet (median over rounds), /health under 100 ms throughout (every
probe of every round), no 429 for the other client (while the unread streams run or after), and key B no hit.
The result records the command, the machine and its load (uptime before and after), every round's raw row and
the medians.
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from bench.common import launch_server, scrape_metrics, stop_server, write_report


def big_schema(seed: int, target_bytes: int) -> dict:
    """About `target_bytes` of JSON schema, its names unique to `seed`: an object of groups of 40 required fields
    (a flat object of thousands of optional ones is past llguidance's limit on alternatives, and fails)."""
    groups, size, g = {}, 0, 0
    while size < target_bytes:
        fields = {
            f"s{seed}_g{g}_f{i}": {"type": "string", "maxLength": 20}
            if i % 2
            else {"type": "integer", "minimum": 0, "maximum": 999}
            for i in range(40)
        }
        group = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
        groups[f"s{seed}_group_{g}"] = group
        size += len(json.dumps(group))
        g += 1
    return {"type": "object", "properties": groups, "required": list(groups), "additionalProperties": False}


def schema_bodies(args) -> list[list[bytes]]:
    """Every round's schema requests, encoded before the victim starts: building and encoding 1.2 MB of JSON in
    the client's event loop would stall the victim's reader and show up as the server's gaps. Distinct schemas in
    every round: none is answered from the compile cache."""
    return [
        [
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "Fill in the form."}],
                    "max_tokens": 8,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "form",
                            "schema": big_schema(1000 + r * args.schemas + i, args.schema_bytes),
                        },
                    },
                }
            ).encode()
            for i in range(args.schemas)
        ]
        for r in range(args.rounds)
    ]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Observer:
    """The victim's stream and the /health prober, recording into the current phase."""

    def __init__(self, url: str, max_tokens: int, headers: dict[str, str]):
        self.url, self.max_tokens, self.headers = url, max_tokens, headers
        self.gaps: list[float] = []
        self.arrivals: list[float] = []  # perf_counter() at each gap's end, beside self.gaps
        self.health: list[float] = []
        self.health_errors = 0
        self.running = True

    def take(self) -> tuple[list[float], list[float], int]:
        out = (self.gaps, self.health, self.health_errors)
        self.gaps, self.arrivals, self.health, self.health_errors = [], [], [], 0
        return out

    def gaps_between(self, start: float, end: float) -> list[float]:
        return [g for g, t in zip(self.gaps, self.arrivals) if start <= t <= end]

    async def victim(self) -> None:
        body = {
            "prompt": "Tell me a long story about the sea.",
            "max_tokens": self.max_tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(timeout=120, headers=self.headers) as client:
            while self.running:
                last = None
                async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                            self.arrivals.append(now)
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
    row = {
        "phase": name,
        "gaps": len(gaps),
        "itl_p50_ms": _ms(percentile(gaps, 0.5)),
        "itl_p99_ms": _ms(percentile(gaps, 0.99)),
        "itl_max_ms": _ms(max(gaps, default=None)),
        "health_probes": len(health),
        "health_p99_ms": _ms(percentile(health, 0.99)),
        "health_max_ms": _ms(max(health, default=None)),
        "health_errors": errors,
        **extra,
    }
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
                except TimeoutError:
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


def unread_stream(url: str, body: bytes, headers: dict[str, str]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up
    sock.connect(("127.0.0.1", urlparse(url).port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return sock


def metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    return scrape_metrics(url, headers)


async def others(url: str, seconds: float, headers: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(
        timeout=900, headers=headers
    ) as client:  # one admitted behind 128 sequences waits its turn

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
    bodies = args.schema_bodies.pop()
    async with httpx.AsyncClient(timeout=600, headers=obs.headers) as client:

        async def constrained(body: bytes):
            t = time.perf_counter()
            r = await client.post(
                f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
            )
            return r.status_code, time.perf_counter() - t

        t = time.perf_counter()
        results = await asyncio.gather(*(constrained(b) for b in bodies))
        burst_end = time.perf_counter()
        await asyncio.sleep(max(0.0, args.quiet - (time.perf_counter() - t)))  # as many gaps as quiet
    burst = obs.gaps_between(t, burst_end)
    return summary(
        "schema",
        *obs.take(),
        request_bytes=[len(b) for b in bodies],
        statuses=[s for s, _ in results],
        request_seconds=[round(x, 2) for _, x in results],
        burst_gaps=len(burst),
        burst_itl_p99_ms=_ms(percentile(burst, 0.99)),
        burst_itl_max_ms=_ms(max(burst, default=None)),
    )


async def slowloris_phase(args, url: str, obs: Observer) -> dict:
    result = multiprocessing.Manager().dict()
    loris = multiprocessing.Process(target=slowloris, args=(url, args.slowloris, args.slowloris_seconds, result))
    loris.start()
    while loris.is_alive():
        await asyncio.sleep(0.5)
    return summary("slowloris", *obs.take(), connections=args.slowloris, **dict(result))


OBSERVED = {"quiet": quiet, "schema": schema, "slowloris": slowloris_phase}


async def never_read(args, url: str, headers: dict[str, str]) -> dict:
    before = metrics(url, headers)
    # 20 top logprobs make each chunk ~4 KB, so a stream outgrows loopback's socket buffers (a few MB) and the
    # server's writes really stall; without them the whole stream fits there and nothing is left unsent.
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": args.unread_tokens,
            "n": 16,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.8,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    socks = [unread_stream(url, body, headers) for _ in range(8)]
    t = time.perf_counter()
    while metrics(url, headers)["orcinus_sequences_admitted"] < 8 * 16:
        await asyncio.sleep(0.1)
    during = await others(url, 2.0, headers)  # the admission queues them (issue 29): no 429 even now
    while True:
        m = metrics(url, headers)
        if m["orcinus_requests_running"] == m["orcinus_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.5)
    engine_done = time.perf_counter() - t
    admitted_after = m["orcinus_sequences_admitted"]
    read_tokens = m["orcinus_generation_tokens_total"] - before["orcinus_generation_tokens_total"]
    after = await others(url, args.after, headers)
    m = metrics(url, headers)
    for sock in socks:
        sock.close()
    row = {
        "phase": "never-read",
        "streams": 8,
        "n": 16,
        "max_tokens": args.unread_tokens,
        "engine_done_seconds": round(engine_done, 1),
        "statuses_while_running": during,
        "sequences_admitted_when_engine_done": admitted_after,
        "tokens_turned_into_chunks": read_tokens,
        "tokens_generated": 8 * 16 * args.unread_tokens,
        "statuses_after_engine_done": after,
        "aborted_by_send_timeout": m["orcinus_requests_aborted_total"] - before["orcinus_requests_aborted_total"],
    }
    print(json.dumps(row), flush=True)
    return row


async def cache_timing(args, url: str, keys: list[str]) -> dict:
    """Per round a fresh long prompt: key A cold, key B, key A warm; latency and prefix-cache hit tokens of each."""
    rounds = []
    async with httpx.AsyncClient(timeout=120) as client:
        for r in range(args.cache_rounds):
            prompt = f"Round {r} of {os.getpid()}: " + "the archive holds a sealed letter about the harbour. " * 45
            row = {}
            for name, key in (("a_cold", keys[0]), ("b", keys[1]), ("a_warm", keys[0])):
                headers = {"Authorization": f"Bearer {key}"}
                before = metrics(url, headers)
                t = time.perf_counter()
                resp = await client.post(
                    f"{url}/v1/completions", headers=headers, json={"prompt": prompt, "max_tokens": 1, "temperature": 0}
                )
                seconds = time.perf_counter() - t
                resp.raise_for_status()
                want = before["orcinus_prefix_cache_queried_tokens"] + resp.json()["usage"]["prompt_tokens"]
                while (m := metrics(url, headers))["orcinus_prefix_cache_queried_tokens"] < want:
                    await asyncio.sleep(0.05)  # the engine's stats come after its tokens
                row[name] = {
                    "ms": _ms(seconds),
                    "hit_tokens": int(m["orcinus_prefix_cache_hit_tokens"] - before["orcinus_prefix_cache_hit_tokens"]),
                }
            row["prompt_tokens"] = resp.json()["usage"]["prompt_tokens"]
            rounds.append(row)
    med = {name: statistics.median(r[name]["ms"] for r in rounds) for name in ("a_cold", "b", "a_warm")}
    row = {
        "phase": "cache-timing",
        "rounds": rounds,
        "median_ms": med,
        "b_hit_tokens": [r["b"]["hit_tokens"] for r in rounds],
        "a_warm_hit_tokens": [r["a_warm"]["hit_tokens"] for r in rounds],
    }
    print(json.dumps(row), flush=True)
    return row


async def run(args, url: str, keys: list[str]) -> list[dict]:
    rows = []
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    observed = [p for p in OBSERVED if p in args.phases]
    if observed:
        obs = Observer(url, args.victim_tokens, headers)
        tasks = [asyncio.create_task(obs.victim()), asyncio.create_task(obs.prober())]
        try:
            deadline = time.monotonic() + 600  # warm-up: a fresh server may build its CPU ops on the first request
            while len(obs.gaps) < 50 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            obs.take()
            for r in range(args.rounds):
                order = observed[r % len(observed) :] + observed[: r % len(observed)]
                for phase in order:
                    print(f"round {r}: {phase}, load average {os.getloadavg()}", flush=True)
                    rows.append(
                        {"round": r, **await OBSERVED[phase](args, url, obs), "load_average_after": os.getloadavg()}
                    )
        finally:
            obs.running = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if "cache-timing" in args.phases and len(keys) >= 2:
        rows.append(await cache_timing(args, url, keys))
    if "never-read" in args.phases:
        rows.append(await never_read(args, url, headers))
    return rows


def verdict(rows: list[dict]) -> dict:
    """Each abuse's p99 gap over its own round's quiet one, the median over rounds; /health over every probe."""
    by = {row["phase"]: row for row in rows if "round" not in row}
    rounds: dict[int, dict[str, dict]] = {}
    for row in rows:
        if "round" in row:
            rounds.setdefault(row["round"], {})[row["phase"]] = row
    out = {}
    for name in ("schema", "slowloris"):
        ratios = [
            rs[name]["itl_p99_ms"] / rs["quiet"]["itl_p99_ms"]
            for rs in rounds.values()
            if name in rs and "quiet" in rs and rs[name]["itl_p99_ms"] and rs["quiet"]["itl_p99_ms"]
        ]
        if ratios:
            out[name] = {
                "itl_p99_over_quiet_per_round": [round(x, 2) for x in ratios],
                "itl_p99_over_quiet_median": round(statistics.median(ratios), 2),
                "itl_within_1_5x": statistics.median(ratios) <= 1.5,
            }
    for name in OBSERVED:
        phase_rows = [rs[name] for rs in rounds.values() if name in rs]
        if phase_rows:
            out.setdefault(name, {}).update(
                {
                    "itl_p99_ms_median": statistics.median(r["itl_p99_ms"] for r in phase_rows),
                    "health_max_ms": max(r["health_max_ms"] for r in phase_rows),
                    "health_under_100ms": all(r["health_max_ms"] < 100 and r["health_errors"] == 0 for r in phase_rows),
                }
            )
    if "cache-timing" in by:
        row = by["cache-timing"]
        out["cache-timing"] = {
            "b_never_hits": not any(row["b_hit_tokens"]),
            "a_warm_always_hits": all(row["a_warm_hit_tokens"]),
            "b_over_a_cold_ms": round(row["median_ms"]["b"] / row["median_ms"]["a_cold"], 2),
            "a_warm_over_a_cold_ms": round(row["median_ms"]["a_warm"] / row["median_ms"]["a_cold"], 2),
        }
    if "never-read" in by:
        row = by["never-read"]
        out["never-read"] = {
            "no_429_while_running": "429" not in row["statuses_while_running"],
            "no_429_after_engine_done": "429" not in row["statuses_after_engine_done"],
        }
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def git_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent,
    ).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of quiet/schema/slowloris, order rotated")
    ap.add_argument(
        "--keys",
        nargs=2,
        default=None,
        metavar=("KEY_A", "KEY_B"),
        help="with --base-url: two of its API keys (default: none; then no cache-timing phase)",
    )
    ap.add_argument("--quiet", type=float, default=20.0, help="seconds of the quiet phase")
    ap.add_argument("--schemas", type=int, default=3)
    ap.add_argument("--schema-bytes", type=int, default=400_000)
    ap.add_argument("--slowloris", type=int, default=1000, help="connections")
    ap.add_argument("--slowloris-seconds", type=float, default=30.0)
    ap.add_argument("--victim-tokens", type=int, default=64)
    ap.add_argument("--unread-tokens", type=int, default=150)
    ap.add_argument("--after", type=float, default=20.0, help="seconds of requests after the engine is done")
    ap.add_argument("--cache-rounds", type=int, default=5)
    phases = [*OBSERVED, "cache-timing", "never-read"]
    ap.add_argument("--phases", nargs="+", default=phases, choices=phases)
    ap.add_argument(
        "--server-flags",
        default="--num-threads 1",
        help="more `orcinus serve` flags (default: one engine thread, a core left for the clients)",
    )
    ap.add_argument("--server-log", default=None, help="write the server's log here")
    ap.add_argument("--note", default="", help="recorded with the result (e.g. what else loaded the machine)")
    ap.add_argument("--out", default="benchmarks/results/serving/abuse.json")
    args = ap.parse_args()
    args.schema_bodies = schema_bodies(args)
    uptime_before = uptime()
    proc, url, keys = None, args.base_url, list(args.keys or [])
    if url is None:
        keys = [f"bench-key-a-{os.getpid()}", f"bench-key-b-{os.getpid()}"]
        with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as keys_file:  # not on the command line
            keys_file.write("\n".join(keys) + "\n")
        log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
        try:
            proc, url = launch_server(
                [*shlex.split(args.server_flags), "--api-key-file", keys_file.name], log=log, timeout=300
            )
        finally:
            os.unlink(keys_file.name)  # read at startup
    try:
        rows = asyncio.run(run(args, url, keys))
    finally:
        leaked = stop_server(proc) if proc is not None else []
    del args.schema_bodies
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "uptime_before": uptime_before,
            "uptime_after": uptime(),
            "git_commit": git_commit(),
        },
        "note": args.note,
        "config": vars(args),
        "phases": rows,
        "verdict": verdict(rows),
        "leaked_shm": leaked,
    }
    print(json.dumps(result["verdict"]))
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
