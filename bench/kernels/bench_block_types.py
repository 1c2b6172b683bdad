"""Every block type through BlockLinear (the float32 block matmul) on one model shape, random blocks, rows side by side.

One pass is `--layers` layers of llama-1b's projections (fused Q/K/V, O, fused gate/up, down: K = 2048 and 8192, whole
256-weight blocks for the K-quants); the types alternate within each pass, so all see the same machine. Medians.

    .venv/bin/python -m bench.kernels.bench_block_types --types Q4_1 Q4_K Q6_K Q2_K --rows 1 4 16 --out F.json
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # [N, K]: qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from gguf import GGMLQuantizationType

    from bench.common import write_report
    from engine.model.quantized import BlockLinear
    from tests.test_quantized import random_blocks

    torch.set_num_threads(args.threads)
    shapes = SHAPES * args.layers
    layers = {
        t: [BlockLinear([random_blocks(GGMLQuantizationType[t], n, k, seed=i)]) for i, (n, k) in enumerate(shapes)]
        for t in args.types
    }
    result = {"threads": args.threads, "shapes": shapes, "median_ms": {}}
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        times: dict[str, list[float]] = {t: [] for t in args.types}
        for p in range(args.passes + 2):
            for t in args.types:
                start = time.perf_counter()
                for layer, x in zip(layers[t], xs):
                    layer(x)
                if p >= 2:  # warm-up passes
                    times[t].append((time.perf_counter() - start) * 1e3)
        result["median_ms"][rows] = {t: statistics.median(v) for t, v in times.items()}
        print(f"rows {rows}: " + ", ".join(f"{t} {statistics.median(v):.1f} ms" for t, v in times.items()), flush=True)
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
