"""The CPU attention op alone (cuda/paged_decode_attention_cpu.cpp): n query rows of one request (a decode, or a
decode verifying n - 1 draft tokens) at several context lengths, SmolLM2's 9 query / 3 KV heads of 64, float32,
microseconds a call (one layer), median of many calls on a cache in memory. `--tree DIR` imports another checkout's
op (give it its own TORCH_EXTENSIONS_DIR: the builds share a name); its op took one block table per row.

    .venv/bin/python loadtest/bench_cpu_attention.py --threads 2 --out benchmarks/cpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="checkout to import from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9, 17, 32])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from engine.attention.cpu_backend import _kernels

    op = _kernels().paged_decode_attention
    grouped = "| None" in (op.__doc__ or "") or "Optional" in (op.__doc__ or "")  # the new op takes row_requests
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 4096
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim)
    result = {}
    for ctx in args.contexts:
        for n in args.rows:
            q = torch.randn(n, heads, head_dim)
            table = torch.randperm(num_blocks)[: -(-(ctx + n) // block_size)].int()
            lens = torch.tensor([ctx + j + 1 for j in range(n)], dtype=torch.int32)
            if grouped:  # one table, every row of request 0
                call = (q, cache, table[None], torch.zeros(n, dtype=torch.int32), lens, 0.125, 0, 0.0)
            else:
                call = (q, cache, table.repeat(n, 1), lens, 0.125, 0, 0.0)
            for _ in range(20):
                op(*call)
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                op(*call)
                times.append(time.perf_counter() - start)
            result[f"{ctx}x{n}"] = statistics.median(times) * 1e6
            print(f"context {ctx:>5}, {n:>2} rows: {result[f'{ctx}x{n}']:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "tree": args.tree,
                                              "rows_share_reads": grouped, "median_us": result}, indent=2))


if __name__ == "__main__":
    main()
