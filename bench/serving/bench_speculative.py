"""Speculative decoding side by side (issue 30): `orcinus serve` variants (speculation off, ngram, suffix) and any
number of already running peers (llama.cpp's `llama-server`, with and without its n-gram speculation), on two chat
workloads, closed-loop streaming clients at several concurrencies, rounds interleaved, medians over rounds.

(a) input-grounded: rewrite / extract / convert / code-edit requests whose answers reuse their prompt, greedy;
(b) open chat: stories, explanations, advice, at temperature 0.7, unseeded (as chat UIs send them; a seeded sampled
request does not speculate).
Every prompt is unique (random names, numbers and identifiers drawn from a seed per round and workload, the same for
every system): no system's prefix cache or suffix tree sees a prompt, or its answer, twice.

    W=/tmp/peer bench/peers/start_llama_server.sh
    W=/tmp/peer PORT=8102 EXTRA="--spec-type ngram-simple" bench/peers/start_llama_server.sh
    python -m bench.serving.bench_speculative --variant off="--speculative off" --variant ngram="--speculative ngram" \\
        --peer llama=http://127.0.0.1:8101 --peer llama-ngram=http://127.0.0.1:8102 \\
        --out benchmarks/results/speculative/all_workloads.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time

import httpx

from bench.common import chat_chunks, scrape_metrics, served_all, write_report
from bench.serving.compare_llama_server import peer_settings

NAMES = [
    "Alice",
    "Bruno",
    "Chen",
    "Dalia",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jules",
    "Kofi",
    "Lena",
    "Marta",
    "Nils",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tomas",
    "Uma",
    "Vera",
    "Wes",
    "Yuki",
]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quebec", "Tunis", "Perth", "Krakow", "Austin", "Hanoi"]
THINGS = [
    "a red bicycle",
    "three old books",
    "a blue umbrella",
    "a wooden chair",
    "two green apples",
    "a silver watch",
    "a paper map",
    "a glass jar",
    "a warm scarf",
    "a small radio",
]
VERBS = ["bought", "found", "repaired", "painted", "sold", "borrowed", "packed", "cleaned", "lost", "gave away"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["total", "count", "price", "value", "score", "index", "item", "name", "data", "result", "limit", "step"]
ANIMALS = ["fox", "owl", "whale", "tortoise", "cat", "dragon", "robot", "penguin", "wolf", "bee"]
TOPICS = [
    "photosynthesis",
    "gravity",
    "the water cycle",
    "compound interest",
    "volcanoes",
    "the internet",
    "vaccines",
    "electricity",
    "tides",
    "rainbows",
    "black holes",
    "recycling",
]
ACTIVITIES = [
    "learning to cook",
    "running a first marathon",
    "keeping a garden",
    "saving money",
    "sleeping well",
    "learning a language",
    "moving to a new city",
    "starting to paint",
]


def story(rng: random.Random, n: int) -> str:
    return " ".join(
        f"On {rng.choice(DAYS)}, {rng.choice(NAMES)} from {rng.choice(CITIES)} {rng.choice(VERBS)} "
        f"{rng.choice(THINGS)}."
        for _ in range(n)
    )


def function(rng: random.Random) -> str:
    name, a, b, c = rng.sample(WORDS, 4)
    k = [rng.randint(2, 99) for _ in range(4)]
    return (
        f"def get_{name}({a}, {b}, {c}):\n    {name} = {a} * {k[0]}\n    if {name} > {b}:\n"
        f"        {name} = {name} - {b}\n    else:\n        {name} = {name} + {c}\n"
        f"    for i in range({k[1]}):\n        {name} = {name} + i * {k[2]}\n        if {name} > {c}:\n"
        f"            {name} = {name} % {k[3]}\n    return {name}\n"
    )


def grounded(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return f"Rewrite this text, replacing every day of the week with 'today':\n\n{story(rng, 8)}"
    if kind == 1:
        return f"Copy these sentences as a numbered list, one per line:\n\n{story(rng, 8)}"
    if kind == 2:
        rows = "\n".join(
            f"Name: {rng.choice(NAMES)}, Age: {rng.randint(18, 90)}, City: {rng.choice(CITIES)}" for _ in range(8)
        )
        return f"Convert these records to a JSON list of objects with keys name, age and city:\n\n{rows}"
    if kind == 3:
        return f"Add a docstring to this Python function and return the whole function:\n\n{function(rng)}"
    return f"Rename the variable `i` to `step` in this code and return the full code:\n\n{function(rng)}"


def chat(rng: random.Random) -> str:
    return rng.choice(
        [
            f"Write a short story about a {rng.choice(ANIMALS)} who lives in {rng.choice(CITIES)}.",
            f"Explain {rng.choice(TOPICS)} to a ten-year-old.",
            f"Give me five tips for {rng.choice(ACTIVITIES)}.",
            f"Write a poem about {rng.choice(TOPICS)} and {rng.choice(THINGS)}.",
        ]
    )


WORKLOADS = {"grounded": (grounded, 0.0), "chat": (chat, 0.7)}


async def closed_loop(
    url: str, model: str, workload: str, concurrency: int, warmup: float, seconds: float, seed: int, max_tokens: int
) -> dict:
    """`concurrency` clients, each sending its next request when the last one ends; output tokens counted over the
    window after `warmup` seconds, at full concurrency throughout (requests still under way at its end are cut off).

    A streamed chunk may carry several tokens (a step's accepted drafts), so a chunk counts as the run's mean tokens
    per chunk, taken from the usage of the requests that ended."""
    make, temperature = WORKLOADS[workload]
    rng = random.Random(seed)
    prompts = iter(lambda: make(rng), None)
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)
    chunks_in_window = 0
    usage_tokens, usage_chunks, latencies = 0, 0, []

    async def request(http: httpx.AsyncClient) -> None:
        nonlocal chunks_in_window, usage_tokens, usage_chunks
        body = {
            "model": model,
            "messages": [{"role": "user", "content": next(prompts)}],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream_options": {"include_usage": True},
        }
        t, chunks, usage = time.perf_counter(), 0, None
        async for chunk in chat_chunks(http, url, body):
            usage = chunk.get("usage") or usage
            if any(c["delta"].get("content") for c in chunk.get("choices", ())):
                chunks += 1
                if window[0] <= time.perf_counter() < window[1]:
                    chunks_in_window += 1
        usage_tokens += usage["completion_tokens"]
        usage_chunks += chunks
        latencies.append(time.perf_counter() - t)

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < window[1]:
            try:
                await asyncio.wait_for(request(http), timeout=max(0.0, window[1] - time.perf_counter()))
            except TimeoutError:  # cut off at the window's end: its chunks so far have counted
                return

    # A new connection per request: llama-server may close a kept-alive one just as the next request reuses it.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    tokens_per_chunk = usage_tokens / max(1, usage_chunks)
    return {
        "output_tok_s": chunks_in_window * tokens_per_chunk / seconds,
        "completed": len(latencies),
        "tokens_per_chunk": tokens_per_chunk,
        "mean_output_tokens": usage_tokens / max(1, len(latencies)),
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "seed": seed,
    }


def metrics(url: str) -> dict[str, float]:
    m = scrape_metrics(url)
    keep = (
        "orcinus_spec_decode_draft_tokens",
        "orcinus_spec_decode_accepted_tokens",
        "orcinus_generation_tokens_total",
    )
    return {k: m.get(k, 0.0) for k in keep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an `orcinus serve` with these flags (repeatable)",
    )
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=URL", help="a running server (repeatable)")
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--warmup", type=float, default=10, help="seconds at full concurrency before the window")
    ap.add_argument("--seconds", type=float, default=60, help="the measured window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed-base", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant) or {"off": "--speculative off"}
    peers = dict(p.split("=", 1) for p in args.peer)

    with served_all({name: shlex.split(flags) for name, flags in variants.items()}) as servers:
        urls = {**peers, **servers}
        systems = list(urls)
        runs: dict = {w: {str(c): {s: [] for s in systems} for c in args.concurrency} for w in args.workload}
        for r in range(args.rounds):
            for w in args.workload:
                for c in args.concurrency:
                    seed = args.seed_base + 1000 * r + 10 * c + args.workload.index(w)
                    order = systems[r % len(systems) :] + systems[: r % len(systems)]  # rotate who goes first
                    for s in order:
                        model = httpx.get(f"{urls[s]}/v1/models", timeout=10).json()["data"][0]["id"]
                        before = metrics(urls[s]) if s in servers else {}
                        res = asyncio.run(
                            closed_loop(urls[s], model, w, c, args.warmup, args.seconds, seed, args.max_tokens)
                        )
                        if s in servers:
                            after = metrics(urls[s])
                            res["spec"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                        runs[w][str(c)][s].append(res)
                        print(
                            f"round {r} {w} c={c} {s}: {res['output_tok_s']:.1f} tok/s "
                            f"({res['completed']} requests, {res['mean_output_tokens']:.0f} tokens each)",
                            flush=True,
                        )
        summary = {
            w: {c: {s: statistics.median(x["output_tok_s"] for x in runs[w][c][s]) for s in systems} for c in runs[w]}
            for w in runs
        }
        for w, by_c in summary.items():
            for c, tok_s in by_c.items():
                print(w, f"c={c}", "  ".join(f"{s} {v:.1f}" for s, v in tok_s.items()))
        if args.out:
            write_report(
                args.out,
                {
                    "variants": variants,
                    "peers": {name: {"url": url, **peer_settings(url)} for name, url in peers.items()},
                    "summary_median_output_tok_s": summary,
                    "runs": runs,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
