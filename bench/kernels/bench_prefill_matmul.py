"""A GGUF model's projections at prefill row counts: the achieved multiply-add rate of its block matmuls (the
int16-activation op where the engine uses it) per core, by projection and row count M. CPU time (one thread's, or with
`--threads N` the process's): on a shared machine the work, not the waits for a core. Each pass runs every layer's
projections once, as a prefill chunk of M rows does; row counts alternate pass by pass; medians.

    python -m bench.kernels.bench_prefill_matmul --model /tmp/llama3.2-1b-q4_k_m.gguf --rows 12 64 128 256 512 \\
        --out benchmarks/results/kernels/prefill_matmul_llama3.2-1b.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from bench.common import write_report
from engine.core.config import EngineConfig
from engine.launch import build_engine

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--rows", type=int, nargs="+", default=[12, 64, 128, 256, 512])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads; past 1 the clock is the process's CPU time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = build_engine(EngineConfig(model=args.model, max_num_seqs=1, speculative="off", num_threads=args.threads))
    clock = time.thread_time if args.threads == 1 else time.process_time
    layers = engine.model.layers
    kinds = {name: type(getattr(layers[0], name)).__name__ for name in PROJECTIONS}
    seconds = collections.defaultdict(list)  # (M, projection) -> seconds per pass
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for m in args.rows:
        for name in PROJECTIONS:
            k = getattr(layers[0], name).in_features
            inputs[m, name] = torch.randn(m, k, generator=gen)
    for p in range(args.passes + 1):  # the first pass warms up
        for m in args.rows if p % 2 else args.rows[::-1]:
            for name in PROJECTIONS:
                x = inputs[m, name]
                t0 = clock()
                for layer in layers:
                    getattr(layer, name)(x)
                if p:
                    seconds[m, name].append(clock() - t0)
    results = {}
    for m in args.rows:
        row = {}
        for name in PROJECTIONS:
            proj = getattr(layers[0], name)
            macs = m * proj.in_features * proj.out_features * len(layers)
            s = statistics.median(seconds[m, name])
            row[name] = {"ms": s * 1000, "gmacs_per_s": macs / s / 1e9, "k": proj.in_features, "n": proj.out_features}
        total_macs = sum(
            m * getattr(layers[0], n).in_features * getattr(layers[0], n).out_features for n in PROJECTIONS
        )
        total_s = sum(statistics.median(seconds[m, n]) for n in PROJECTIONS)
        row["all"] = {
            "ms_per_row": total_s / m * 1000,
            "gmacs_per_s": total_macs * len(layers) / total_s / 1e9,
        }
        results[str(m)] = row
        print(
            f"M={m:4d}  {row['all']['ms_per_row']:6.2f} ms/row  {row['all']['gmacs_per_s']:6.1f} GMAC/s per core  "
            + "  ".join(f"{n} {row[n]['gmacs_per_s']:5.1f}" for n in PROJECTIONS),
            flush=True,
        )
    report = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "clock": "thread CPU time" if args.threads == 1 else "process CPU time",
        "modules": kinds,
        "load_average": os.getloadavg(),
        "results": results,
    }
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
