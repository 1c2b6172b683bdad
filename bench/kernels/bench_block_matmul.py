"""The bundled model's block matmuls alone, float32 inputs (BlockLinear) against int16 inputs (Int16BlockLinear).

One pass is every projection of a decode step as the engine groups them (per layer the fused Q/K/V, O, fused gate/up
and down, then the LM head) at R rows, reading the weights from memory as a step does (96 MB, past the caches). The
two kinds alternate pass by pass, so both see the same machine; medians over the passes, and the median of the
per-pair ratios.

    .venv/bin/python -m bench.kernels.bench_block_matmul --threads 2 --rows 1 2 4 8 32 128 --passes 30 \\
        --out benchmarks/results/kernels/block_matmul_int16.json

`--against FILE` times the int16 op built from another int16_matmul.cpp (`git show REV:engine/kernels/csrc/cpu/...`) in
place of the float32 path, and checks that both give the same bits. With `--march haswell` both sides are built for AVX2
(the build AMD's and older Intel CPUs run), so an AVX-512 machine can time that path too.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--against", default=None, help="an older engine/kernels/csrc/cpu/int16_matmul.cpp to time instead of float32"
    )
    ap.add_argument("--march", default="native", help="with --against: build both sides for this -march")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine.kernels.cpu_ops import CPU_SOURCES, load_cpu_extension_copy
    from engine.model.loader import load_checkpoint
    from engine.model.quantized import BlockLinear, Int16BlockLinear

    torch.set_num_threads(args.threads)
    blocks = load_checkpoint(None).blocks
    groups = [
        [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        for i in range(999)
        if f"model.layers.{i}.self_attn.q_proj.weight" in blocks
    ]
    n = len(groups)
    groups += [[f"model.layers.{i}.self_attn.o_proj.weight"] for i in range(n)]
    groups += [[f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up")] for i in range(n)]
    groups += [[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(n)]
    head = "lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"
    groups.append([head])
    base = "float32" if args.against is None else "against"
    if args.march != "native" and args.against is None:
        ap.error("--march needs --against")
    other = (
        None if args.against is None else load_cpu_extension_copy("orcinus_cpu_int16_matmul", args.against, args.march)
    )
    tree = (
        None
        if args.march == "native"
        else load_cpu_extension_copy(
            "orcinus_cpu_int16_matmul", str(CPU_SOURCES / "int16_matmul.cpp"), args.march, tag="tree"
        )
    )
    kinds = {
        base: [
            BlockLinear([blocks[k] for k in g]) if other is None else OtherInt16([blocks[k] for k in g], other)
            for g in groups
        ],
        "int16": [
            Int16BlockLinear([blocks[k] for k in g]) if tree is None else OtherInt16([blocks[k] for k in g], tree)
            for g in groups
        ],
    }
    result = {
        "threads": args.threads,
        "march": args.march,
        "layers": len(groups),
        "weight_bytes": sum(blocks[k].data.numel() for g in groups for k in g),
        "rows": {},
    }
    for rows in args.rows:
        inputs = [torch.randn(rows, layer.in_features) for layer in kinds[base]]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        outputs = {}
        for p in range(args.passes + 3):
            for kind in (base, "int16") if p % 2 else ("int16", base):
                t = time.perf_counter()
                outputs[kind] = [layer(x) for layer, x in zip(kinds[kind], inputs)]
                if p >= 3:  # warm-up passes
                    times[kind].append((time.perf_counter() - t) * 1e3)
        ratios = [f / i for f, i in zip(times[base], times["int16"])]
        result["rows"][rows] = {
            "median_ms": {k: statistics.median(v) for k, v in times.items()},
            f"{base}_over_int16": statistics.median(ratios),
            "samples_ms": times,
        }
        same = ""
        if args.against is not None:
            result["rows"][rows]["same_bits"] = all(map(torch.equal, outputs[base], outputs["int16"]))
            same = f"; same bits: {result['rows'][rows]['same_bits']}"
        print(
            f"rows {rows}: {base} {statistics.median(times[base]):.2f} ms, int16 "
            f"{statistics.median(times['int16']):.2f} ms a pass; ratio {statistics.median(ratios):.3f}x{same}"
        )
    if args.out:
        write_report(args.out, result)


def OtherInt16(parts, ops):
    """An Int16BlockLinear whose packing and matmul are another build's (`ops`)."""
    from engine.model.quantized import BlockLinear, Blocks

    class Other(BlockLinear):
        def _matmul(self, x, out):
            out = x.new_empty(x.shape[0], self.out_features) if out is None else out
            if hasattr(ops, "int16_matmul"):
                return ops.int16_matmul(x, self._parts, self.types, out)
            ops.int16_matmul_out(x.contiguous(), self._parts, self.types, out)  # a build from before int16_matmul
            return out

    return Other([Blocks(ops.packed_type(p.type), ops.pack(p.data, p.type, p.cols), p.cols) for p in parts])


if __name__ == "__main__":
    main()
