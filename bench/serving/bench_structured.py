"""What constraining decoding costs: N concurrent chat requests with a JSON schema against N without, same lengths.

One server (started here on loopback, or --base-url); rounds alternate unconstrained and constrained
batches of --concurrency requests, each with its own seeded prompt, `max_tokens` fixed and `ignore_eos`
on, so every request returns exactly max_tokens tokens in both modes (a constrained one whose JSON
is complete can only take the end token from there on, which still costs its mask each step).
Reports output tok/s per mode (median over rounds) and the constrained/unconstrained ratio.

    python -m bench.serving.bench_structured --out benchmarks/results/serving/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import sys
import time

import httpx

from bench.common import served, write_report

# Long enough that most of max_tokens is JSON, bounded so that the document can end.
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "tags", "items"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "maxItems": 8, "items": {"enum": ["red", "green", "blue", "new", "old", "big"]}},
        "items": {
            "type": "array",
            "maxItems": 20,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "qty"],
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                },
            },
        },
    },
}
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "market",
    "window",
    "paper",
    "signal",
    "summer",
    "forest",
    "bridge",
    "lamp",
    "coffee",
    "music",
]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Make an inventory list for a shop selling {' and '.join(rng.sample(WORDS, 3))}. Reply in JSON."
        for _ in range(n)
    ]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, constrained: bool) -> int:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 1,
        "ignore_eos": True,
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def batch(url: str, texts: list[str], max_tokens: int, constrained: bool) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, url, p, max_tokens, constrained) for p in texts))
        return time.perf_counter() - t, sum(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/serving/structured.json")
    args = ap.parse_args()
    samples: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    server = served(["--max-num-seqs", str(args.concurrency)], timeout=180) if args.base_url is None else None
    with server or contextlib.nullcontext(args.base_url) as url:
        asyncio.run(batch(url, prompts(4, 99), 8, True))  # warm-up, both paths
        asyncio.run(batch(url, prompts(4, 98), 8, False))
        for r in range(args.rounds):
            texts = prompts(args.concurrency, r)
            for mode, rates in samples.items():  # alternate, so drift on a shared machine hits both alike
                secs, tokens = asyncio.run(batch(url, texts, args.max_tokens, mode == "json_schema"))
                assert tokens == args.concurrency * args.max_tokens, tokens
                rates.append(tokens / secs)
                print(f"round {r} {mode:>13}: {tokens} tokens in {secs:.1f} s = {tokens / secs:.1f} tok/s", flush=True)
    med = {m: statistics.median(v) for m, v in samples.items()}
    ratio = med["json_schema"] / med["unconstrained"]
    line = (
        f"output tok/s, {args.concurrency} concurrent: json_schema {med['json_schema']:.1f} vs unconstrained "
        f"{med['unconstrained']:.1f} = {ratio:.3f} ({(1 - ratio) * 100:.1f}% lower; goal <= 15%)"
    )
    print(line)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "schema": SCHEMA,
        "config": vars(args),
        "samples_tok_s": samples,
        "median_tok_s": med,
        "ratio": ratio,
        "summary_line": line,
    }
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
