"""The CPU attention op alone (engine/kernels/csrc/cpu/paged_decode_attention.cpp): n query rows spread over some
requests (a decode, or decodes verifying draft tokens) at several context lengths, SmolLM2's 9 query / 3 KV heads of
64 (`--heads 4 1 256`: Gemma 3's), float32, microseconds a call (one layer), median of many calls; `--layers 30`
cycles through 30 layers' caches, so their keys come from memory, as in a model's step, not from the last-level
cache. `--against FILE` builds another copy of the op's source (`git show
REV:engine/kernels/csrc/cpu/paged_decode_attention.cpp > FILE`) and times it call for call against this tree's over a
cache of the first of --cache-dtypes, comparing their outputs' bits. `--cache-dtypes float32 bfloat16 float16` times
this tree's op over a cache of each dtype (float32 queries; --kv-cache-dtype), call for call, the ratios to float32's
as paired medians.

    .venv/bin/python -m bench.kernels.bench_cpu_attention --threads 2 \\
        --out benchmarks/results/kernels/cpu_attention.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default=None, help="another paged_decode_attention.cpp to time beside this one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9, 17, 32])
    ap.add_argument("--requests", type=int, default=1, help="the rows split over this many requests, in runs")
    ap.add_argument("--layers", type=int, default=1, help="caches cycled through, one a call")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "DIM"))
    ap.add_argument("--cache-dtypes", nargs="+", default=["float32"], help="this tree's op over caches of each dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine.attention.cpu_backend import _kernels
    from engine.kernels.cpu_ops import load_cpu_extension_copy

    tree = _kernels().paged_decode_attention
    # name -> (op, cache dtype): "tree" is this tree's over float32, "tree:DTYPE" over a DTYPE cache.
    ops = {("tree" if d == "float32" else f"tree:{d}"): (tree, getattr(torch, d)) for d in args.cache_dtypes}
    if args.against:
        ops["against"] = (
            load_cpu_extension_copy("orcinus_cpu_attention", args.against).paged_decode_attention,
            getattr(torch, args.cache_dtypes[0]),
        )
    first = "tree" if args.cache_dtypes[0] == "float32" else f"tree:{args.cache_dtypes[0]}"
    torch.set_num_threads(args.threads)
    (heads, kv_heads, head_dim), block_size = args.heads, 16
    result = {"requests": args.requests, "heads": args.heads, "median_us": {}}
    for ctx in args.contexts:
        for n in args.rows:
            q = torch.randn(n, heads, head_dim)
            per_table = -(-(ctx + n) // block_size)
            num_blocks = per_table * args.requests + 8
            caches = [torch.randn(2, kv_heads, num_blocks, block_size, head_dim) for _ in range(args.layers)]
            typed = {d: [c.to(d) for c in caches] for d in {dt for _, dt in ops.values()}}
            tables = torch.randperm(num_blocks)[: per_table * args.requests].int().view(args.requests, per_table)
            requests = torch.tensor([r * args.requests // n for r in range(n)], dtype=torch.int32)
            lens = torch.tensor(
                [ctx + 1 + r - int((requests == requests[r]).nonzero()[0]) for r in range(n)], dtype=torch.int32
            )  # a request's rows: ctx + 1, ctx + 2, ... keys
            calls = {d: [(q, cache, tables, requests, lens, 0.125, 0, 0.0) for cache in cs] for d, cs in typed.items()}
            outputs = {k: op(*calls[d][0]) for k, (op, d) in ops.items()}
            for _ in range(20):
                for op, d in ops.values():
                    op(*calls[d][0])
            times = {k: [] for k in ops}
            sweeps = {k: [] for k in ops}  # a sweep: every layer once
            names = sorted(ops)
            for i in range(args.calls):
                for k in names[i % len(names) :] + names[: i % len(names)]:  # who goes first rotates
                    op, d = ops[k]
                    sweep = 0.0
                    for call in calls[d]:
                        start = time.perf_counter()
                        op(*call)
                        times[k].append(time.perf_counter() - start)
                        sweep += times[k][-1]
                    sweeps[k].append(sweep)
            row = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            line = f"context {ctx:>5}, {n:>2} rows: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items())
            if args.against:  # the median of paired sweeps' ratios: the machine's speed drifts between pairs
                row["against_over_tree"] = statistics.median(a / t for a, t in zip(sweeps["against"], sweeps[first]))
                row["same_bits"] = torch.equal(outputs[first], outputs["against"])
                line += f"; against / tree {row['against_over_tree']:.2f}x, same bits {row['same_bits']}"
            for k in ops:
                if k.startswith("tree:") and "tree" in ops:  # paired sweeps' ratio, as for --against
                    row[f"{k}_over_tree"] = statistics.median(a / t for a, t in zip(sweeps[k], sweeps["tree"]))
                    line += f"; {k} / tree {row[f'{k}_over_tree']:.2f}x"
            result["median_us"][f"{ctx}x{n}"] = row
            print(line, flush=True)
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
