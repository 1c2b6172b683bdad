"""A lone stream's wall time per token, served, from two or more checkouts in turn: `orcinus serve` from each tree
(its own engine and ops), one greedy request at a time, streamed and not, rounds interleaved. Per token: a request of
N tokens less one of 1 token (the same prompt), over N - 1, so the prompt's prefill and the HTTP round trip cancel.
Speculation off by default, so a token is a decode step plus what the engine loop and the gateway add to it.

    python -m bench.serving.lone_stream_trees --trees /tmp/base . --rounds 4 \\
        --out benchmarks/results/serving/lone_stream_trees.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import httpx

from bench.common import served, write_report


def ms_per_token(url: str, tokens: int, stream: bool) -> float:
    body = {"model": "m", "prompt": "Once upon a time", "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=600).raise_for_status()
    t1 = time.perf_counter()
    many = {**body, "max_tokens": tokens, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=many, timeout=600) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
    else:
        httpx.post(f"{url}/v1/completions", json=many, timeout=600).raise_for_status()
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="checkouts to compare (each serves its own engine)")
    ap.add_argument("--model", default=None, help="a GGUF every tree serves (default: the bundled model)")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flags", default="--speculative off", help="more `orcinus serve` flags, for every tree")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = [*args.flags.split(), "--served-model-name", "m"] + (["--model", args.model] if args.model else [])
    modes = ("stream", "plain")
    samples = {tree: {m: [] for m in modes} for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            root = Path(tree).resolve()
            with served(flags, root=root, env={"PYTHONPATH": str(root)}) as url:
                ms_per_token(url, 16, False)  # warm-up
                for mode in modes:
                    samples[tree][mode].append(ms_per_token(url, args.tokens, mode == "stream"))
            print(f"round {r} {tree}: " + ", ".join(f"{m} {samples[tree][m][-1]:.3f} ms" for m in modes), flush=True)
    medians = {tree: {m: statistics.median(v) for m, v in s.items()} for tree, s in samples.items()}
    first = args.trees[0]
    for tree in args.trees:
        print(
            f"{tree:<24} "
            + "  ".join(f"{m} {medians[tree][m]:.3f} ms ({medians[tree][m] / medians[first][m]:.3f}x)" for m in modes)
        )
    if args.out:
        write_report(
            args.out,
            {
                "model": args.model or "the bundled model",
                "tokens": args.tokens,
                "flags": flags,
                "load_average": os.getloadavg(),
                "samples_ms_per_token": samples,
                "medians_ms_per_token": medians,
            },
        )


if __name__ == "__main__":
    main()
