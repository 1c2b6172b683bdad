"""Serving benchmark for any OpenAI-compatible `/v1/completions` endpoint (HTTP only).

Orca-shaped workload: input lengths ~U[32, 512] tokens (sent as token-id prompts, so lengths are
exact), output lengths ~U[1, 128] via `max_tokens` + `ignore_eos`, seeded. Open loop (Poisson
arrivals at --request-rate) or closed loop (--max-concurrency). Every request streams; we record
TTFT, time per output token, inter-token latencies, end-to-end and normalized latency (e2e / output
tokens, as the Orca paper plots), and throughput.

    python -m bench.serving.bench_serving --base-url http://127.0.0.1:8000 --num-prompts 50 --request-rate 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from bench.common import write_report


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 50  # requests to send
    input_len: tuple[int, int] = (32, 512)  # prompt tokens ~ U[lo, hi]
    output_len: tuple[int, int] = (1, 128)  # max_tokens ~ U[lo, hi], with ignore_eos
    vocab: tuple[int, int] = (1000, 30000)  # token ids drawn from this range
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        stream = self.stream()
        return [next(stream) for _ in range(self.num_prompts)]

    def stream(self):
        """The same requests, without end: a timed run takes as many as it has time for (the same ones, in the same
        order, whichever server it drives)."""
        rng = random.Random(self.seed)
        while True:
            yield [rng.randint(*self.vocab) for _ in range(rng.randint(*self.input_len))], rng.randint(*self.output_len)


@dataclass
class Result:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def normalized_latency(self) -> float:
        return self.e2e / max(self.output_tokens, 1)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    res = Result(len(prompt), max_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res.start = t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.ok = True
                    break
                event = json.loads(data)
                if event.get("error"):
                    res.error = str(event["error"])
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks  # servers without include_usage: one chunk per token
    return res


async def run_timed(
    base_url: str, model: str, workload: Workload, concurrency: int, seconds: float
) -> tuple[list[Result], float]:
    """Closed loop for `seconds`: each of `concurrency` clients sends the workload's next request as soon as its
    last one ends, until the time is up; requests started before then run to their end and count."""
    stream = workload.stream()
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def loop():
            while time.perf_counter() - t0 < seconds:
                prompt, max_tokens = next(stream)
                results.append(await one_request(client, url, model, prompt, max_tokens))

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return results, duration


async def run(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float,
    max_concurrency: int | None,
    progress: bool = True,
) -> tuple[list[Result], float]:
    reqs = workload.requests()
    rng = random.Random(workload.seed + 1)
    limit = asyncio.Semaphore(max_concurrency or len(reqs))
    url = base_url.rstrip("/") + "/v1/completions"
    bar = tqdm(total=len(reqs), desc=f"rate {request_rate}", disable=not progress, leave=False)
    timeout = httpx.Timeout(None, connect=10.0)
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def send(prompt, max_tokens):
            async with limit:
                r = await one_request(client, url, model, prompt, max_tokens)
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in reqs:
            tasks.append(asyncio.create_task(send(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        v = sorted(values)
        return {"mean": statistics.fmean(v), "p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(len(v) * 0.99))]}

    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": out_tokens,
        "ttft_s": stats([r.ttft for r in ok]),
        "tpot_s": stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_s": stats([x for r in ok for x in r.itl]),
        "e2e_s": stats([r.e2e for r in ok]),
        "normalized_latency_s": stats([r.normalized_latency for r in ok]),
    }


def print_table(summary: dict) -> None:
    print(f"completed {summary['completed']}  failed {summary['failed']}  duration {summary['duration_s']:.1f} s")
    print(f"throughput: {summary['request_throughput']:.3f} req/s, {summary['output_throughput']:.1f} output tok/s")
    print(f"{'metric':<24}{'mean':>10}{'p50':>10}{'p99':>10}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_latency_s"):
        s = summary[key]
        if s["mean"] is None:
            continue
        print(f"{key:<24}" + "".join(f"{s[k] * 1000:>9.1f}m" for k in ("mean", "p50", "p99")))
    print("(milliseconds)")
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most this many in flight")
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("LO", "HI"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[1, 128], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="closed loop for this many seconds (with --max-concurrency) instead of --num-prompts",
    )
    ap.add_argument("--out", default=None, help="write the summary and per-request results as JSON")
    args = ap.parse_args()

    workload = Workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed=args.seed)
    if args.duration is not None:
        if not args.max_concurrency:
            ap.error("--duration needs --max-concurrency")
        results, duration = asyncio.run(
            run_timed(args.base_url, args.model, workload, args.max_concurrency, args.duration)
        )
    else:
        results, duration = asyncio.run(
            run(args.base_url, args.model, workload, args.request_rate, args.max_concurrency)
        )
    summary = summarize(results, duration)
    print_table(summary)
    if args.out:
        report = {
            "workload": asdict(workload),
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "summary": summary,
            "requests": [asdict(r) | {"itl": r.itl} for r in results],
        }
        write_report(args.out, report)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
