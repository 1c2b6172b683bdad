"""Every block type through BlockLinear (the float32 block matmul), and with `--paths` through Int16BlockLinear (int16
activations), on one model shape, random blocks, rows side by side.

One pass is `--layers` layers of llama-1b's projections (fused Q/K/V, O, fused gate/up, down: K = 2048 and 8192, whole
256-weight blocks for the K-quants), or with `--shapes wide` one up projection and a slice of the LM head; the types and
paths alternate within each pass, so all see the same machine. Medians, in ms a pass and G weights/s.

    .venv/bin/python -m bench.kernels.bench_block_types --types Q4_1 Q4_K Q6_K Q2_K --rows 1 4 16 --out F.json
    .venv/bin/python -m bench.kernels.bench_block_types --types Q4_0 Q5_0 Q4_K Q6_K --paths float32 int16 \
        --shapes wide --rows 1 8 --layers 1 --out F.json
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {  # [N, K]
    "llama-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],  # qkv, o, gate_up, down
    "wide": [(8192, 2048), (32768, 2048)],  # llama-1b's up projection; a quarter of its LM head
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K"])
    ap.add_argument("--paths", nargs="+", default=["float32"], choices=["float32", "int16"])
    ap.add_argument("--shapes", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from gguf import GGMLQuantizationType

    from bench.common import write_report
    from engine.model.quantized import BlockLinear, Int16BlockLinear
    from tests.test_quantized import random_blocks

    torch.set_num_threads(args.threads)
    shapes = SHAPES[args.shapes] * args.layers
    weights = sum(n * k for n, k in shapes)
    kinds = {"float32": BlockLinear, "int16": Int16BlockLinear}
    blocks = {
        t: [random_blocks(GGMLQuantizationType[t], n, k, seed=i) for i, (n, k) in enumerate(shapes)] for t in args.types
    }
    layers = {
        f"{t}/{p}": [kinds[p]([b]) for b in blocks[t]] for t in args.types for p in args.paths
    }  # fmt: skip
    result = {
        "threads": args.threads,
        "shapes": shapes,
        "weights_per_pass": weights,
        "median_ms": {},
        "g_weights_per_s": {},
    }
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        times: dict[str, list[float]] = {key: [] for key in layers}
        for p in range(args.passes + 2):
            for key, ls in layers.items():
                start = time.perf_counter()
                for layer, x in zip(ls, xs):
                    layer(x)
                if p >= 2:  # warm-up passes
                    times[key].append((time.perf_counter() - start) * 1e3)
        medians = {key: statistics.median(v) for key, v in times.items()}
        result["median_ms"][rows] = medians
        result["g_weights_per_s"][rows] = {key: weights / (ms * 1e6) for key, ms in medians.items()}
        print(
            f"rows {rows}: "
            + ", ".join(f"{key} {ms:.1f} ms ({weights / (ms * 1e6):.1f} G/s)" for key, ms in medians.items()),
            flush=True,
        )
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
