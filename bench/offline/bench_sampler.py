"""The sampler alone (engine/model/sampling/): a step's sample-and-finish for R rows of a 49k vocabulary, greedy and at
temperature 0.7 (what chat clients send), and torch.multinomial's draw over the same rows beside it (the draw
engine/model/sampling/draw.py replaced). Median of many calls.

    .venv/bin/python -m bench.offline.bench_sampler --threads 2 --rows 1 8 24 64 \\
        --out benchmarks/results/kernels/sampler.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_report


def timed(f, calls: int) -> float:
    """Median milliseconds of f() over `calls` calls, after three to warm up."""
    for _ in range(3):
        f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 24, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "vocab": args.vocab, "rows": {}}
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        cell = {}
        for temperature in (0.0, 0.7):
            sampler = Sampler(seed=1)
            ids = [f"r{i}" for i in range(rows)]
            for i in ids:
                sampler.add(SamplingState(i, [1, 2, 3], SamplingParams(temperature=temperature), frozenset(), []))
            cell[f"sample_ms_t{temperature}"] = timed(lambda: sampler.finish(sampler.sample(logits, ids)), args.calls)
        probs = (logits / 0.7).softmax(-1)
        generator = torch.Generator().manual_seed(2)
        cell["torch_multinomial_ms"] = timed(lambda: torch.multinomial(probs, 1, generator=generator), args.calls)
        result["rows"][rows] = cell
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.3f}" for k, v in cell.items()), flush=True)
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
