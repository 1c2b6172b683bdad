"""Length-aware scheduling side by side (issue 31): `orcinus serve` under fcfs, predicted and oracle, on the mixed
workload (bench/serving/length_workload.py) with Poisson arrivals at shares of the saturation rate, runs interleaved.

The saturation rate is FCFS's: the output tokens per second enough closed-loop clients draw from it at steady state
(the engine's own counter, after a warm-up), over the workload's mean output length (`--mean-output-tokens`, as
bench/serving/eval_length_predictor.py measured it on its held-out requests).
Each run sends the same arrival schedule (prompts, times, max_tokens) to each policy, streamed, greedy; the oracle
(and any variant named oracle...) gets each request's real output length (from the run just before it; who goes
first rotates from round to round, since this machine's speed drifts) in its `priority` field. Per run: mean and p99 end-to-end latency, median TTFT,
output tokens per second, latency by kind of answer, and preemptions. `--alone` also sends each run's requests to the
FCFS server one at a time: each request with the machine to itself, the floor under any order's mean end-to-end
latency and TTFT (a request shares every step it runs in, and gets no more of it than alone).

`--null-model REPORT` runs the engine in-process instead, with no model and a simulated clock, on a KV cache sized
to hold a few requests' contexts, so that requests queue and the machine's noise cannot reach the figures
(bench/serving/length_null.py).

    python -m bench.serving.eval_length_predictor --train 2000 --predictor /tmp/length.safetensors
    python -m bench.serving.bench_length_aware --length-predictor /tmp/length.safetensors \\
        --out benchmarks/results/length_aware/served.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import chat_chunks, scrape_metrics, served_all, write_report
from bench.serving.length_workload import request


async def stream_one(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float | None, int]:
    """(seconds to the first token, completion tokens) of one streamed chat request."""
    t, first, usage = time.perf_counter(), None, None
    async for chunk in chat_chunks(http, url, body):
        if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            first = time.perf_counter() - t
        usage = chunk.get("usage") or usage
    return first, usage["completion_tokens"]


def body(model: str, prompt: str, max_tokens: int, priority: int = 0) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
        "priority": priority,
    }


async def timed(http: httpx.AsyncClient, url: str, payload: dict, kind: str, at: float) -> dict:
    """One request's row: its kind, arrival, TTFT, end-to-end seconds and output tokens."""
    sent = time.perf_counter()
    ttft, tokens = await stream_one(http, url, payload)
    return {"kind": kind, "arrival_s": at, "ttft_s": ttft, "e2e_s": time.perf_counter() - sent, "output_tokens": tokens}


async def open_loop(
    url: str, model: str, schedule: list[tuple[float, str, str, int]], lengths: list[int] | None
) -> dict:
    """Send each request at its time; wait for all. `lengths`: the oracle's priorities."""
    rows: list[dict] = [{} for _ in schedule]
    start = time.perf_counter()

    async def one(i: int, at: float, kind: str, prompt: str, max_tokens: int, http: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        rows[i] = await timed(http, url, body(model, prompt, max_tokens, lengths[i] if lengths else 0), kind, at)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        await asyncio.gather(*(one(i, *s, http) for i, s in enumerate(schedule)))
    return summarize(rows, time.perf_counter() - start)


async def one_at_a_time(url: str, model: str, schedule: list[tuple[float, str, str, int]]) -> dict:
    """Each request of the schedule alone, the next sent when the last has finished."""
    rows = []
    async with httpx.AsyncClient(timeout=3600) as http:
        start = time.perf_counter()
        for at, kind, prompt, max_tokens in schedule:
            rows.append(await timed(http, url, body(model, prompt, max_tokens), kind, at))
    return summarize(rows, time.perf_counter() - start)


def summarize(rows: list[dict], elapsed: float) -> dict:
    e2e = sorted(r["e2e_s"] for r in rows)
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    return {
        "requests": len(rows),
        "elapsed_s": elapsed,
        "output_tok_s": sum(r["output_tokens"] for r in rows) / elapsed,
        "e2e_mean_s": statistics.fmean(e2e),
        "e2e_p99_s": e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))],
        "ttft_median_s": statistics.median(ttfts),
        "e2e_mean_by_kind_s": {
            k: statistics.fmean(r["e2e_s"] for r in rows if r["kind"] == k) for k in sorted({r["kind"] for r in rows})
        },
        "rows": rows,
    }


def generated_tokens(url: str) -> float:
    return scrape_metrics(url)["orcinus_generation_tokens_total"]


async def saturation_tokens(url: str, model: str, clients: int, warmup: float, seconds: float, seed: int) -> float:
    """Output tokens per second that `clients` closed-loop clients draw, measured after `warmup` seconds."""
    rng = random.Random(seed)

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            _, prompt, max_tokens = request(rng)
            await stream_one(http, url, body(model, prompt, max_tokens))

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(clients)]
        await asyncio.sleep(warmup)
        t0, n0 = time.perf_counter(), generated_tokens(url)
        await asyncio.sleep(seconds)
        rate = (generated_tokens(url) - n0) / (time.perf_counter() - t0)
        for task in tasks:
            task.cancel()  # a closed stream aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
    return rate


def poisson(rng: random.Random, rate: float, seconds: float) -> list[tuple[float, str, str, int]]:
    schedule, t = [], rng.expovariate(rate)
    while t < seconds:
        kind, prompt, max_tokens = request(rng)
        schedule.append((t, kind, prompt, max_tokens))
        t += rng.expovariate(rate)
    return schedule


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length-predictor", help="a trained predictor (bench/serving/eval_length_predictor.py)")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95], help="shares of the saturation rate")
    ap.add_argument("--seconds", type=float, default=90, help="arrivals per run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed-base", type=int, default=0, help="arrival schedules and prompts from seeds after this")
    ap.add_argument("--saturation-clients", type=int, default=64)
    ap.add_argument("--saturation-seconds", type=float, default=60)
    ap.add_argument("--saturation-warmup", type=float, default=60)
    ap.add_argument(
        "--mean-output-tokens",
        type=float,
        help="the workload's mean output length (eval_length_predictor.py's held-out requests)",
    )
    ap.add_argument("--flags", default="", help="more `orcinus serve` flags for every policy")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more server to compare, with these flags (PREDICTOR in them: the trained predictor)",
    )
    ap.add_argument(
        "--alone", action="store_true", help="also each run's requests one at a time (the floor no order reaches)"
    )
    ap.add_argument("--out", default=None)
    null = ap.add_argument_group("--null-model: the engine in-process, no model, a simulated clock (length_null.py)")
    null.add_argument("--null-model", metavar="REPORT", help="eval_length_predictor's report: its held-out rows")
    null.add_argument("--kv-contexts", type=float, default=8, help="KV blocks for this many mean contexts")
    null.add_argument(
        "--step-cost-ms",
        type=float,
        nargs=3,
        default=[6.0, 2.5, 1.4],
        metavar=("FIXED", "DECODE_ROW", "PROMPT_TOKEN"),
        help="a step's simulated cost",
    )
    null.add_argument("--max-num-seqs", type=int, default=64)
    null.add_argument("--capacity-warmup", type=float, default=120, help="simulated seconds")
    null.add_argument("--capacity-seconds", type=float, default=600, help="simulated seconds")
    args = ap.parse_args()
    if args.null_model:
        from bench.serving import length_null

        return length_null.main(args)
    if args.length_predictor is None or args.mean_output_tokens is None:
        ap.error("--length-predictor and --mean-output-tokens are required (unless --null-model)")
    work = Path(tempfile.mkdtemp(prefix="length_aware_"))
    predictor = work / "length.safetensors"  # a copy: the server goes on learning into it
    shutil.copy(args.length_predictor, predictor)
    from bench.serving import length_oracle  # the servers import it too, by the name it registers

    variants = {
        "fcfs": ["--scheduling-policy", "fcfs"],
        "predicted": ["--scheduling-policy", "predicted", "--length-predictor", str(predictor)],
        "oracle": ["--scheduling-policy", length_oracle.NAME],
    }
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        variants[name] = flags.replace("PREDICTOR", str(predictor)).split()
    oracles = [n for n in variants if n.startswith("oracle")]  # given the true lengths
    with served_all({name: flags + args.flags.split() for name, flags in variants.items()}) as urls:
        model = httpx.get(f"{urls['fcfs']}/v1/models", timeout=10).json()["data"][0]["id"]
        tok_s = asyncio.run(
            saturation_tokens(
                urls["fcfs"], model, args.saturation_clients, args.saturation_warmup, args.saturation_seconds, seed=99
            )
        )
        rate = tok_s / args.mean_output_tokens
        print(f"saturation: {tok_s:.1f} output tok/s, {rate:.2f} requests/s", flush=True)
        time.sleep(5)  # the aborted requests leave
        runs: dict = {str(load): {name: [] for name in variants} for load in args.loads}
        for r in range(args.rounds):
            for load in args.loads:
                schedule = poisson(
                    random.Random(args.seed_base + 1000 * r + int(100 * load)), load * rate, args.seconds
                )
                # Who goes first rotates (the machine's speed drifts within a round); the oracle goes second, taking
                # its lengths from the first (greedy: every policy gives the same tokens).
                others = [n for n in variants if n not in oracles]
                order = others[r % len(others) :] + others[: r % len(others)]
                order[1:1] = oracles
                lengths = None
                for name in order:
                    preempted = scrape_metrics(urls[name])["orcinus_preemptions"]
                    res = asyncio.run(open_loop(urls[name], model, schedule, lengths if name in oracles else None))
                    res["preemptions"] = scrape_metrics(urls[name])["orcinus_preemptions"] - preempted
                    if lengths is None:
                        lengths = [row["output_tokens"] for row in res["rows"]]
                    runs[str(load)][name].append(res)
                    print(
                        f"round {r} load {load} {name}: mean e2e {res['e2e_mean_s']:.2f}s p99 {res['e2e_p99_s']:.2f}s "
                        f"median TTFT {res['ttft_median_s']:.3f}s {res['output_tok_s']:.1f} tok/s "
                        f"({res['requests']} requests, {res['preemptions']:.0f} preemptions)",
                        flush=True,
                    )
                if args.alone:
                    res = asyncio.run(one_at_a_time(urls["fcfs"], model, schedule))
                    runs[str(load)].setdefault("alone", []).append(res)
                    fcfs = runs[str(load)]["fcfs"][-1]
                    print(
                        f"round {r} load {load} alone: mean e2e {res['e2e_mean_s']:.2f}s (fcfs "
                        f"{fcfs['e2e_mean_s'] / res['e2e_mean_s']:.2f}x it) median TTFT {res['ttft_median_s']:.3f}s "
                        f"(fcfs {fcfs['ttft_median_s'] / res['ttft_median_s']:.2f}x it)",
                        flush=True,
                    )
        summary = {
            load: {
                name: {
                    k: statistics.median(x[k] for x in xs)
                    for k in ("e2e_mean_s", "e2e_p99_s", "ttft_median_s", "output_tok_s")
                }
                for name, xs in by.items()
                if xs
            }
            for load, by in runs.items()
        }
        for load, by in summary.items():
            f, p = by["fcfs"], by["predicted"]
            print(
                f"load {load}: predicted vs fcfs: mean e2e {f['e2e_mean_s'] / p['e2e_mean_s']:.2f}x lower, "
                f"median TTFT {f['ttft_median_s'] / p['ttft_median_s']:.2f}x lower, p99 {p['e2e_p99_s'] / f['e2e_p99_s']:.2f}x "
                f"fcfs's, throughput {p['output_tok_s'] / f['output_tok_s']:.2f}x",
                flush=True,
            )
            if "alone" in by:
                a = by["alone"]
                print(
                    f"load {load}: fcfs vs each request alone: mean e2e {f['e2e_mean_s'] / a['e2e_mean_s']:.2f}x, "
                    f"median TTFT {f['ttft_median_s'] / a['ttft_median_s']:.2f}x (no order lowers them further)",
                    flush=True,
                )
        if args.out:
            write_report(
                args.out,
                {
                    "variants": variants,
                    "saturation_output_tok_s": tok_s,
                    "saturation_rate": rate,
                    "summary": summary,
                    "runs": runs,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
