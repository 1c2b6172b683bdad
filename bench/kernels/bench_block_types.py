"""Every block type through BlockLinear (the float32 block matmul), and with `--paths` through Int16BlockLinear (int16
activations), on one model shape, random blocks, rows side by side.

One pass is `--layers` layers of llama-1b's projections (fused Q/K/V, O, fused gate/up, down: K = 2048 and 8192, whole
256-weight blocks for the K-quants), or with `--shapes wide` one up projection and a slice of the LM head; the types and
paths alternate within each pass, so all see the same machine. Medians, in ms a pass and G weights/s.

    .venv/bin/python -m bench.kernels.bench_block_types --types Q4_1 Q4_K Q6_K Q2_K --rows 1 4 16 --out F.json
    .venv/bin/python -m bench.kernels.bench_block_types --types Q4_0 Q5_0 Q4_K Q6_K --paths float32 int16 \
        --shapes wide --rows 1 8 --layers 1 --out F.json

`--paths int16 against --against FILE` times the int16 op built from another int16_matmul.cpp (`git show
REV:engine/kernels/csrc/cpu/int16_matmul.cpp`) beside this tree's, checks both give the same bits, and reports the
bytes each packs a weight into; `--march haswell` builds both sides for AVX2. `--clock cpu` times the thread's CPU
time (one thread), not the wall clock: on a shared machine the figure is the work, not the wait.
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
    ap.add_argument("--paths", nargs="+", default=["float32"], choices=["float32", "int16", "against"])
    ap.add_argument("--against", default=None, help="an older int16_matmul.cpp: the `against` path's op")
    ap.add_argument("--march", default="native", help="build the int16 op (and --against) for this -march")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the thread's CPU time (1 thread)")
    ap.add_argument("--shapes", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if ("against" in args.paths) != (args.against is not None):
        ap.error("the `against` path and --against go together")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts one thread's time: pass --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    import torch
    from gguf import GGMLQuantizationType

    from bench.common import write_report
    from bench.kernels.bench_block_matmul import OtherInt16
    from engine.kernels.cpu_ops import CPU_SOURCES, load_cpu_extension_copy
    from engine.model.quantized import BlockLinear, Int16BlockLinear
    from tests.test_quantized import random_blocks

    torch.set_num_threads(args.threads)
    shapes = SHAPES[args.shapes] * args.layers
    weights = sum(n * k for n, k in shapes)
    kinds = {"float32": BlockLinear, "int16": Int16BlockLinear}
    if args.march != "native":
        tree = load_cpu_extension_copy(
            "orcinus_cpu_int16_matmul", str(CPU_SOURCES / "int16_matmul.cpp"), args.march, "tree"
        )
        kinds["int16"] = lambda parts: OtherInt16(parts, tree)
    if args.against is not None:
        other = load_cpu_extension_copy("orcinus_cpu_int16_matmul", args.against, args.march)
        kinds["against"] = lambda parts: OtherInt16(parts, other)
    blocks = {
        t: [random_blocks(GGMLQuantizationType[t], n, k, seed=i) for i, (n, k) in enumerate(shapes)] for t in args.types
    }
    layers = {
        f"{t}/{p}": [kinds[p]([b]) for b in blocks[t]] for t in args.types for p in args.paths
    }  # fmt: skip
    result = {
        "threads": args.threads,
        "march": args.march,
        "clock": args.clock,
        "bytes_per_weight": {
            key: sum(p.numel() for layer in ls for p in layer._parts) / weights for key, ls in layers.items()
        },
        "shapes": shapes,
        "weights_per_pass": weights,
        "median_ms": {},
        "g_weights_per_s": {},
    }
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        times: dict[str, list[float]] = {key: [] for key in layers}
        outputs = {}
        for p in range(args.passes + 2):
            for key in list(layers) if p % 2 else list(layers)[::-1]:  # alternate which goes first
                start = clock()
                outputs[key] = [layer(x) for layer, x in zip(layers[key], xs)]
                if p >= 2:  # warm-up passes
                    times[key].append((clock() - start) * 1e3)
        medians = {key: statistics.median(v) for key, v in times.items()}
        result["median_ms"][rows] = medians
        if args.against is not None:
            result.setdefault("same_bits", {})[rows] = {
                t: all(map(torch.equal, outputs[f"{t}/int16"], outputs[f"{t}/against"])) for t in args.types
            }
            print(f"rows {rows}: same bits {result['same_bits'][rows]}", flush=True)
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
