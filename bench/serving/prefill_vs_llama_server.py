"""Prefill speed beside llama-server on the same GGUF: prompt-only requests (max_tokens 1; the peer with
cache_prompt false), one at a time, the two servers alternating who goes first; medians of wall time and of each
server's process-tree CPU time per prompt token, which holds on a shared machine where wall time does not.

    THREADS=2 NP=1 CTX_PER_SLOT=4096 MODEL=F ALIAS=NAME bench/peers/start_llama_server.sh
    python -m bench.serving.prefill_vs_llama_server --model F --llama-model-name NAME \\
        --out benchmarks/results/serving/prefill_vs_llama_server_NAME.json

Prompts are random token ids, fresh for every request, so neither prompt cache hits.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.common import launch_server, stop_server, write_report
from bench.serving.compare_llama_server import peer_settings
from bench.serving.lone_stream_cpu import _cmdline, tree_cpu_seconds


def orcinus_request(http: httpx.Client, url: str, model: str, ids: list[int]) -> int:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
    r = http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def llama_request(http: httpx.Client, url: str, model: str, ids: list[int]) -> int:
    body = {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0.0}
    r = http.post(f"{url}/completion", json=body)
    r.raise_for_status()
    return r.json()["tokens_evaluated"]


def timed(send, http, url, model, pid, ids) -> dict:
    c0, t0 = tree_cpu_seconds(pid), time.perf_counter()
    n = send(http, url, model, ids)
    wall, cpu = time.perf_counter() - t0, tree_cpu_seconds(pid) - c0
    return {"tokens": n, "wall_s": wall, "cpu_s": cpu}


def summary(samples: list[dict]) -> dict:
    n = statistics.median(s["tokens"] for s in samples)
    wall = statistics.median(s["wall_s"] for s in samples)
    return {
        "prompt_tokens": n,
        "wall_ms": wall * 1000,
        "tok_s": n / wall,
        "cpu_ms_per_token": statistics.median(s["cpu_s"] / s["tokens"] * 1000 for s in samples),
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF both servers serve")
    ap.add_argument("--llama-url", default="http://127.0.0.1:8101")
    ap.add_argument("--llama-model-name", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[150, 500, 1500])
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 5, 3], help="timed prompts per length")
    ap.add_argument("--threads", type=int, default=2, help="Orcinus --num-threads (start llama-server with as many)")
    ap.add_argument("--flags", default="", help="more orcinus serve flags")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    peer = peer_settings(args.llama_url)
    llama_pid = next(int(d.name) for d in Path("/proc").glob("[0-9]*") if _cmdline(d) == peer["cmdline"])
    name = Path(args.model).stem
    flags = [
        "--model",
        args.model,
        "--served-model-name",
        name,
        "--num-threads",
        str(args.threads),
        *args.flags.split(),
    ]
    proc, url = launch_server(flags)
    systems = {
        "orcinus": (orcinus_request, url, name, proc.pid),
        "llama-server": (llama_request, args.llama_url, args.llama_model_name, llama_pid),
    }
    results: dict = {}
    try:
        with httpx.Client(timeout=900) as http:
            for tokens, prompts in zip(args.tokens, args.prompts, strict=True):
                got: dict = {s: [] for s in systems}
                for i in range(prompts + 1):  # the first of each length warms up
                    order = list(systems) if i % 2 == 0 else list(systems)[::-1]
                    for s in order:
                        ids = [rng.randrange(1000, 20000) for _ in range(tokens)]
                        r = timed(*systems[s][:1], http, *systems[s][1:], ids)
                        if i:
                            got[s].append(r)
                results[str(tokens)] = {s: summary(v) for s, v in got.items()}
                o, ll = results[str(tokens)]["orcinus"], results[str(tokens)]["llama-server"]
                results[str(tokens)]["orcinus_vs_llama_tok_s"] = o["tok_s"] / ll["tok_s"]
                results[str(tokens)]["orcinus_vs_llama_cpu"] = ll["cpu_ms_per_token"] / o["cpu_ms_per_token"]
                print(
                    f"{tokens:5d} tokens  orcinus {o['tok_s']:7.1f} tok/s {o['cpu_ms_per_token']:6.2f} CPU ms/tok  "
                    f"llama-server {ll['tok_s']:7.1f} tok/s {ll['cpu_ms_per_token']:6.2f} CPU ms/tok",
                    flush=True,
                )
    finally:
        stop_server(proc)
    report = {
        "model": args.model,
        "llama_server": peer,
        "threads": args.threads,
        "orcinus_flags": flags,
        "load_average": os.getloadavg(),
        "results": results,
    }
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
