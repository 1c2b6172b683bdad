"""Time a mixed step's attention on a GPU: prompt rows by tiles (paged_prompt_tiles.cu) vs one decode query a row.

    python -m bench.gpu.bench_prompt_tiles --out benchmarks/results/gpu/prompt_tiles.json

Each row is one layer's attention of a step as a whole-step graph hands it to `forward_decode` (a row per query,
engine/runner/decode_graphs.py): 64 decoding requests beside one prompt chunk, Llama-1B's heads by default. Both ways
are first checked against float32 SDPA, then timed as bench_attention times the kernel: the graph-safe call captured
in a CUDA graph, replayed between two events. The JSON at --out is rewritten after every row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.common import write_report
from bench.kernels.bench_attention import DTYPES, graph_time_ms, make_batch, reference
from engine.attention.backend import AttentionMetadata
from engine.attention.prompt_tiles import plan_prompt_tiles, prompt_row_signs, rows_per_tile

DECODES = 64  # requests decoding beside the prompt chunk
# (prompt chunk tokens, tokens cached before it): profile_host's 400-token prompt, the 512-row bucket's largest fresh
# chunk, a chunk after a cached prefix, and a chunk alone.
STEPS = {
    "64 decodes + 128-token prompt": (128, 0, DECODES),
    "64 decodes + 400-token prompt": (400, 0, DECODES),
    "64 decodes + 448 after 256 cached": (448, 256, DECODES),
    "512-token prompt alone": (512, 0, 0),
}


def graph_rows(q, cache, meta, tiles: bool) -> AttentionMetadata:
    """A row per query with its request's table and its own key count; with tiles, prompt rows' counts negated and
    the tile plan attached (as DecodeGraphRunner fills its buffers)."""
    lens, ctx = meta.query_lens_cpu, meta.context_lens_cpu
    rows = sum(lens)
    keys = torch.tensor([c - n + j + 1 for n, c in zip(lens, ctx) for j in range(n)], dtype=torch.int32)
    plan = None
    if tiles:
        keys *= torch.from_numpy(prompt_row_signs(lens, rows))
        tile_rows = rows_per_tile(q.shape[1], cache.shape[1])
        plan = torch.from_numpy(plan_prompt_tiles(lens, ctx, tile_rows, tables_by_row=True)).to(q.device)
    requests = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], device=q.device)
    return AttentionMetadata(
        torch.arange(rows + 1, dtype=torch.int32, device=q.device),
        keys.to(q.device),
        meta.block_tables[requests],
        meta.slot_mapping,
        [1] * rows,
        [abs(k) for k in keys.tolist()],
        prompt_tiles=plan,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-context", type=int, default=512, help="keys of each decoding request")
    p.add_argument("--iters", type=int, default=20, help="graph replays per timed run (x 8 calls each)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    from engine.attention.cuda_backend import CudaAttention  # needs CuPy and a GPU; import after --help

    backend, dtype, gen = CudaAttention(), DTYPES[args.dtype], torch.Generator().manual_seed(0)
    hkv, hq, d = args.kv_heads, args.kv_heads * args.group, args.head_dim
    tile_rows = backend.prompt_tile_rows(dtype, hq, hkv, d, torch.device("cuda"))
    results = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "heads": [hq, hkv, d],
        "tile_rows": tile_rows,
        "rows": [],
        "complete": False,
    }
    if not tile_rows:
        print("the prompt-tile kernel does not take this shape here", flush=True)
        return 1
    for name, (n, cached, decodes) in STEPS.items():
        requests = [(1, args.decode_context)] * decodes + [(n, cached + n)]
        q, cache, meta = make_batch(requests, hq, hkv, d, args.block_size, dtype, gen)
        want = reference(q, cache, meta)
        row = {"step": name, "rows": q.shape[0], "prompt_keys": sum(range(cached + 1, cached + n + 1))}
        for way, tiles in (("per_row", False), ("tiled", True)):
            rows = graph_rows(q, cache, meta, tiles)
            got = backend.forward_decode(q, cache, rows).float()
            row[f"{way}_rel_error"] = ((got - want).norm() / want.norm()).item()
            row[f"{way}_ms"] = graph_time_ms(backend, q, cache, rows, args.iters)
        row["ok"] = max(row["per_row_rel_error"], row["tiled_rel_error"]) < 1e-2
        row["per_row_over_tiled"] = row["per_row_ms"] / row["tiled_ms"]
        results["rows"].append(row)
        print(
            f"{name:36s} per row {row['per_row_ms']:.3f} ms, tiled {row['tiled_ms']:.3f} ms "
            f"({row['per_row_over_tiled']:.1f}x), rel errors {row['per_row_rel_error']:.1e} "
            f"{row['tiled_rel_error']:.1e} {'ok' if row['ok'] else 'FAIL'}",
            flush=True,
        )
        if args.out:
            write_report(args.out, results)
    results["complete"] = True
    if args.out:
        write_report(args.out, results)
    return 0 if all(r["ok"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
