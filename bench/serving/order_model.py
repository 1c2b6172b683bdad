"""How much can the order of requests cut mean latency when a step's cost grows with its rows? (issue 31)

A queueing model, not a measurement: Poisson arrivals of the length workload's kinds (a word, a sentence, a list,
a paragraph, a story: 8 / 24 / 80 / 256 / 384 tokens, equally likely), one token per running request per step, and
a step of b requests costing (c + b) / (c + 1) of a lone request's step, so b requests produce b / (c + b) of the
most tokens a second. c follows from how much faster than a lone request a full batch is (here a lone request
decodes at ~40-70% of saturation's tok/s: c ~0.5-1.5; a GPU's decode step, nearly free per row, has a large c).
Every policy knows the true lengths (the oracle's ceiling): `all` runs every request every step (Orca, FCFS's
batches); `cap N` runs the N shortest remaining; `half N` the shorter half, at least N; `srpt` one at a time.

    python -m bench.serving.order_model --out benchmarks/results/length_aware/order_model.json
"""

from __future__ import annotations

import argparse
import math
import random

from bench.common import write_report

SIZES = (8, 24, 80, 256, 384)


def mean_latency(take, load: float, c: float, n: int, seed: int) -> float:
    """Mean end-to-end time (in a lone request's steps) of `n` requests at `load` of the most tokens a second;
    `take(num_in_system)` is how many of the shortest remaining run each step."""
    rng = random.Random(seed)
    rate = load * (c + 1) / (sum(SIZES) / len(SIZES))  # arrivals per lone step: a full batch makes c + 1 tokens a step
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append((t, rng.choice(SIZES)))
    now, i, jobs, total = 0.0, 0, [], 0.0
    while i < n or jobs:
        while i < n and arrivals[i][0] <= now:
            jobs.append([arrivals[i][1], arrivals[i][0]])
            i += 1
        if not jobs:
            now = arrivals[i][0]
            continue
        jobs.sort()
        running = jobs[: take(len(jobs))]
        now += (c + len(running)) / (c + 1)
        for job in running:
            job[0] -= 1
        total += sum(now - arrived for left, arrived in jobs if left <= 0)
        jobs = [job for job in jobs if job[0] > 0]
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--c", type=float, nargs="+", default=[0.5, 1.0, 8.0])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    policies = {
        "cap 8": lambda k: 8,
        "cap 4": lambda k: 4,
        "half 8": lambda k: max(8, math.ceil(k / 2)),
        "half 2": lambda k: max(2, math.ceil(k / 2)),
        "srpt": lambda k: 1,
    }
    results = []
    for c in args.c:
        for load in args.loads:
            base = mean_latency(lambda k: k, load, c, args.requests, args.seed)
            gains = {
                name: round(base / mean_latency(take, load, c, args.requests, args.seed), 3)
                for name, take in policies.items()
            }
            results.append({"c": c, "load": load, "all_mean_steps": round(base, 1), "gain_over_all": gains})
            print(
                f"c {c} load {load}: all {base:.0f} steps; mean latency all / policy: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in gains.items()),
                flush=True,
            )
    if args.out:
        write_report(args.out, {"sizes": SIZES, "results": results})


if __name__ == "__main__":
    main()
