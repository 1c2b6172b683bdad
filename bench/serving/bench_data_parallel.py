"""Data-parallel replicas on one machine: (a) two replicas of one thread each against one engine of two threads,
closed-loop clients; (b) multi-turn chat on two replicas, cache-aware against round-robin routing.

(a) Each client sends a streamed completion (a seeded prompt of 40-200 words, `max_tokens` tokens, ignore_eos) and
the next as soon as it ends; output tok/s, TTFT and latency p50 over a window after a warm-up. (b) is
bench/serving/bench_multiturn.py's workload (distinct seeded system prompts, every turn resends the history; users
arrive over --think-time seconds and think that long on average between turns, so their turns do not march in
step) on `--data-parallel-size 2` under each routing policy: prefix-cache hit rate and TTFT p50 of turns 2+. Variants run
in alternation, a fresh server each, --rounds times; medians over the rounds.

    python -m bench.serving.bench_data_parallel --out benchmarks/results/scaling/data_parallel.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

from bench.common import served, write_report
from bench.serving.bench_multiturn import WORDS, conversations, median_of, pct, run_mode

CLOSED_LOOP = {"dp2": ["--data-parallel-size", "2", "--num-threads", "1"], "one": ["--num-threads", "2"]}
ROUTING = {
    "cache-aware": ["--data-parallel-size", "2", "--routing", "cache-aware"],
    "round-robin": ["--data-parallel-size", "2", "--routing", "round-robin"],
}


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 200))).capitalize() + "." for _ in range(n)]


async def closed_loop(url: str, clients: int, warmup: float, seconds: float, max_tokens: int, seed: int) -> dict:
    """`clients` clients, each sending its next request when the last ends; figures over the window after warm-up."""
    pool = prompts(512, seed)
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)
    done: list[tuple[float, float, int]] = []  # (ttft, e2e, tokens) of requests that ended inside the window
    tokens_in_window = 0
    failed = 0

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens_in_window, failed
        rng = random.Random(f"{seed}-{i}")
        while time.perf_counter() < window[1]:
            body = {
                "prompt": rng.choice(pool),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.perf_counter()
            ttft, n = None, 0
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or line == "data: [DONE]":
                            continue
                        if '"error"' in line:
                            raise RuntimeError(line)
                        now = time.perf_counter()
                        ttft = ttft or now - t0
                        n += 1  # one token per event (no stop strings, no drafts: speculation writes one per step)
                        if window[0] <= now < window[1]:
                            tokens_in_window += 1
            except (httpx.HTTPError, RuntimeError):
                failed += 1
                continue
            end = time.perf_counter()
            if window[0] <= t0 and end < window[1]:
                done.append((ttft, end - t0, n))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return {
        "output_tok_s": tokens_in_window / seconds,
        "requests": len(done),
        "failed": failed,
        "ttft_p50_s": pct([d[0] for d in done], 0.5),
        "latency_p50_s": pct([d[1] for d in done], 0.5),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", nargs="+", default=["closed-loop", "routing"], choices=["closed-loop", "routing"])
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--warmup", type=float, default=15)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--conversations",
        type=int,
        nargs="+",
        default=[16, 40],
        help="chat users (one conversation each); at 16 both replicas' caches hold every conversation, "
        "at 40 one replica's holds about half of them",
    )
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-max-tokens", type=int, default=32)
    ap.add_argument(
        "--think-time",
        type=float,
        default=4.0,
        help="chat users' mean seconds between a reply and their next turn (exponential; 0: none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/scaling/data_parallel.json")
    args = ap.parse_args()
    out = Path(args.out)
    result = {"config": vars(args), "closed_loop": {}, "routing": {}}

    if "closed-loop" in args.part:
        runs: dict[str, dict[int, list[dict]]] = {v: {c: [] for c in args.clients} for v in CLOSED_LOOP}
        for r in range(args.rounds):
            for variant, flags in CLOSED_LOOP.items():  # alternate, so drift on a shared machine hits both alike
                with served(flags, out.with_suffix(f".{variant}-{r}.server.log"), timeout=300) as url:
                    for c in args.clients:
                        res = asyncio.run(
                            closed_loop(url, c, args.warmup, args.seconds, args.max_tokens, args.seed + r)
                        )
                        runs[variant][c].append(res)
                        print(
                            f"round {r} {variant:>4} {c:>3} clients: {res['output_tok_s']:.1f} tok/s, TTFT p50 "
                            f"{res['ttft_p50_s']:.3f} s, latency p50 {res['latency_p50_s']:.2f} s, "
                            f"failed {res['failed']}",
                            flush=True,
                        )
                result["closed_loop"] = {"runs": runs}
                write_report(out, result)
        medians = {
            v: {
                c: {k: median_of(rs, k) for k in ("output_tok_s", "ttft_p50_s", "latency_p50_s")}
                for c, rs in by_c.items()
            }
            for v, by_c in runs.items()
        }
        result["closed_loop"] = {
            "medians": medians,
            "dp2_over_one_tok_s": {
                c: medians["dp2"][c]["output_tok_s"] / medians["one"][c]["output_tok_s"] for c in args.clients
            },
            "runs": runs,
        }
        write_report(out, result)

    if "routing" in args.part:
        runs_r: dict[int, dict[str, list[dict]]] = {n: {p: [] for p in ROUTING} for n in args.conversations}
        for r in range(args.rounds):
            for n in args.conversations:
                convs = conversations(n, args.turns, (150, 300), (30, 80), args.seed)
                for policy, flags in ROUTING.items():
                    with served(flags, out.with_suffix(f".{policy}-{n}-{r}.server.log"), timeout=300) as url:
                        res = asyncio.run(run_mode(url, convs, args.chat_max_tokens, args.think_time))
                    runs_r[n][policy].append(res)
                    print(
                        f"round {r} {n:>3} users {policy:>11}: hit rate {res['hit_rate']:.3f}, TTFT p50 turns 2+ "
                        f"{res['ttft_p50_later_turns_s'] * 1000:.0f} ms, {res['output_tok_s']:.1f} tok/s, "
                        f"failed {res['failed']}",
                        flush=True,
                    )
                    result["routing"] = {"runs": runs_r}
                    write_report(out, result)
        keys = ("hit_rate", "ttft_p50_later_turns_s", "ttft_p50_s", "output_tok_s")
        result["routing"] = {"by_users": {}, "runs": runs_r}
        for n, by_policy in runs_r.items():
            medians_r = {p: {k: median_of(rs, k) for k in keys} for p, rs in by_policy.items()}
            ca, rr = medians_r["cache-aware"], medians_r["round-robin"]
            summary = {
                "medians": medians_r,
                "hit_rate_ratio": ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None,
                "ttft_p50_later_turns_ratio_rr_over_ca": rr["ttft_p50_later_turns_s"] / ca["ttft_p50_later_turns_s"],
            }
            result["routing"]["by_users"][n] = summary
            print(
                f"{n} users, cache-aware vs round-robin: hit rate {ca['hit_rate']:.3f} vs {rr['hit_rate']:.3f} "
                f"({summary['hit_rate_ratio']:.2f}x; goal >= 1.8x), TTFT p50 turns 2+ "
                f"{ca['ttft_p50_later_turns_s'] * 1000:.0f} vs {rr['ttft_p50_later_turns_s'] * 1000:.0f} ms "
                f"({summary['ttft_p50_later_turns_ratio_rr_over_ca']:.2f}x lower; goal >= 1.5x)"
            )
        write_report(out, result)
    if "closed-loop" in args.part:
        for c, ratio in result["closed_loop"]["dp2_over_one_tok_s"].items():
            print(f"{c} clients: two replicas x 1 thread / one engine x 2 threads = {ratio:.2f}x output tok/s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
