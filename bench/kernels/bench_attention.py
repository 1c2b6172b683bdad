"""Check and time the CUDA attention backend (engine/attention/cuda_backend.py) on a GPU.

    python -m bench.kernels.bench_attention --out benchmarks/results/gpu/bench_attention.json

(a) correctness: fresh random ragged batches (prefill-only, decode-only, mixed; GQA 1, 3, 8; lengths
    1..8192 incl. block boundaries) against float32 SDPA per request, by relative error;
(b) speed: the backend's whole attention call (the decode kernel, flash attention or SDPA for prefill
    chunks; the model writes the cache before it) vs torch SDPA on the same work (one call per request
    on pre-gathered K/V, and one padded-batch call with a mask), and for decode vs the floor = K/V
    bytes / copy bandwidth;
(c) for decode batches, the kernel alone: the graph-safe `forward_decode` captured in a CUDA graph and
    replayed between two events, so the eager rows' fixed Python and launch cost is out of the
    figure; the floor ratio of a decode batch is read from this row.
The JSON at --out is rewritten after every row, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import write_report
from engine.attention.backend import AttentionMetadata, write_kv

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def make_batch(requests, hq, hkv, d, bs, dtype, gen):
    """requests: (n new tokens, ctx) pairs -> (q, cache, meta), the new K/V already in the randomly placed blocks."""
    nbs = [-(-c // bs) for _, c in requests]
    perm = torch.randperm(sum(nbs) + 1, generator=gen)
    tables = torch.zeros(len(requests), max(nbs), dtype=torch.int32)
    slots, at = [], 0
    for i, ((n, c), nb) in enumerate(zip(requests, nbs)):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
        pos = torch.arange(c - n, c)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
    t = sum(n for n, _ in requests)
    cache = torch.randn(2, hkv, sum(nbs) + 1, bs, d, generator=gen).to(dtype).cuda()
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).cuda() for h in (hq, hkv, hkv))
    qsl = torch.tensor([0] + [n for n, _ in requests]).cumsum(0).int()
    meta = AttentionMetadata(
        qsl.cuda(),
        torch.tensor([c for _, c in requests], dtype=torch.int32).cuda(),
        tables.cuda(),
        torch.cat(slots).cuda(),
        [n for n, _ in requests],
        [c for _, c in requests],
    )
    write_kv(k, v, cache, meta.slot_mapping)
    return q, cache, meta


def per_request(q, cache, meta):
    """(query [1, Hq, n, D], keys, values [1, Hkv, ctx, D], SDPA mask kwargs) per request, K/V gathered.
    Full prefills use is_causal (so SDPA may pick flash attention), chunks an explicit mask, decodes none."""
    bs, qsl, out = cache.shape[3], meta.query_start_loc.tolist(), []
    for i, (n, c) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        table = meta.block_tables[i, : -(-c // bs)].long()
        kv = cache[:, :, table].flatten(2, 3)[:, :, :c]  # [2, Hkv, ctx, D]
        pos = torch.arange(c, device=q.device) <= torch.arange(c - n, c, device=q.device)[:, None]
        mask = {} if n == 1 else {"is_causal": True} if n == c else {"attn_mask": pos}
        out.append((q[qsl[i] : qsl[i + 1]].transpose(0, 1)[None], kv[0][None], kv[1][None], mask))
    return out


def reference(q, cache, meta):
    outs = [
        F.scaled_dot_product_attention(qq.float(), kk.float(), vv.float(), **m, enable_gqa=True)
        for qq, kk, vv, m in per_request(q, cache, meta)
    ]
    return torch.cat([o[0].transpose(0, 1) for o in outs])


def padded(q, cache, meta):
    """One SDPA call: queries padded to the longest query run, keys to the longest context."""
    reqs, dev = per_request(q, cache, meta), q.device
    nmax, lmax = max(meta.query_lens_cpu), max(meta.context_lens_cpu)
    B, hq, hkv, d = len(reqs), q.shape[1], cache.shape[1], q.shape[2]
    qp = torch.zeros(B, hq, nmax, d, dtype=q.dtype, device=dev)
    kp, vp = (torch.zeros(B, hkv, lmax, d, dtype=q.dtype, device=dev) for _ in range(2))
    mask = torch.zeros(B, 1, nmax, lmax, dtype=torch.bool, device=dev)
    mask[..., 0] = True  # padded query rows see one key, so they do not produce NaN
    for i, (qq, kk, vv, m) in enumerate(reqs):
        n, c = qq.shape[2], kk.shape[2]
        qp[i, :, :n], kp[i, :, :c], vp[i, :, :c] = qq[0], kk[0], vv[0]
        mask[i, 0, :n, :c] = torch.ones(n, c, dtype=torch.bool, device=dev).tril(c - n)
    return qp, kp, vp, mask


def time_ms(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


GRAPH_CALLS = 8  # forward_decode calls per captured graph: one replay's launch cost spread over eight kernels


def graph_time_ms(backend, q, cache, meta, iters: int) -> float:
    """ms per `forward_decode` call with no Python in the timed region: GRAPH_CALLS calls captured in one CUDA
    graph, replayed `iters` times between two events (median of 5 such runs).

    Back-to-back calls on one cache smaller than the L2 would read it from there, not from memory, and beat
    the K/V floor; so the calls cycle over enough copies of the cache to hold at least 3 L2s between reuses."""
    l2 = getattr(torch.cuda.get_device_properties(q.device), "L2_cache_size", 50 * 2**20)
    copies = min(GRAPH_CALLS, max(1, math.ceil(3 * l2 / (cache.numel() * cache.element_size()))))
    caches = [cache] + [cache.clone() for _ in range(copies - 1)]
    calls = [lambda c=caches[i % copies]: backend.forward_decode(q, c, meta) for i in range(GRAPH_CALLS)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants: compiles, sizes splits
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as the engine's decode graphs capture
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (iters * GRAPH_CALLS))
    del graph, caches
    torch.cuda.empty_cache()
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/ms of a big device-to-device copy_ (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), 20)


CHECKS = {
    "prefill": [(n, n) for n in (1, 15, 16, 17, 255, 1000, 4096)] + [(100, 8192), (8192, 8192)],
    "decode": [(1, c) for c in (1, 2, 15, 16, 17, 31, 32, 33, 511, 2048, 4097, 8191, 8192)],
    "mixed": [(1, 8192), (17, 17), (1, 16), (300, 2000), (1, 1), (64, 64), (1, 513), (16, 4096)],
}
TIMINGS = {
    "decode 1x8192": [(1, 8192)],
    "decode 8x2048": [(1, 2048)] * 8,
    "decode 64x2048": [(1, 2048)] * 64,
    "decode 256x512": [(1, 512)] * 256,
    "decode 16x8192": [(1, 8192)] * 16,
    "prefill 4x1024": [(1024, 1024)] * 4,
    "mixed 2x512+62 dec": [(512, 512)] * 2 + [(1, 1024)] * 62,
}


def variant(backend_class, spec: str, args, gen) -> dict:
    """The decode checks and graph-timed decode rows of the kernel built with a variant's NVRTC options."""
    options = tuple(o for o in spec.partition("=")[2].split(",") if o)
    backend, dtype = backend_class(options), DTYPES[args.dtype]
    d, hkv, bs = args.head_dim, args.kv_heads, args.block_size
    ok = True
    for g in (1, 3, 8):
        q, cache, meta = make_batch(CHECKS["decode"], g * hkv, hkv, d, bs, dtype, gen)
        want = reference(q, cache, meta)
        ok &= ((backend.forward(q, cache, meta).float() - want).norm() / want.norm()).item() < 1e-2
    times = {}
    for name, requests in TIMINGS.items():
        if all(n == 1 for n, _ in requests):
            q, cache, meta = make_batch(requests, args.group * hkv, hkv, d, bs, dtype, gen)
            times[name] = graph_time_ms(backend, q, cache, meta, args.graph_iters)
    return {"options": list(options), "ok": bool(ok), "graph_kernel_ms": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head for the timings")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="timed eager calls per row")
    p.add_argument("--graph-iters", type=int, default=50, help="graph replays per timed run (x 8 kernel calls each)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="also check and graph-time the decode rows with the kernel built with these NVRTC options "
        "(comma-separated), e.g. u2b4=-DORCINUS_DECODE_UNROLL=2,-DORCINUS_DECODE_MIN_BLOCKS=4",
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    from engine.attention.cuda_backend import CudaAttention  # needs CuPy and a GPU; import after --help

    backend, dtype, gen = CudaAttention(), DTYPES[args.dtype], torch.Generator().manual_seed(0)
    d, hkv, bs = args.head_dim, args.kv_heads, args.block_size
    results = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "checks": [],
        "timings": [],
        "complete": False,
    }

    def save() -> None:
        if args.out:
            write_report(args.out, results)

    for kind, requests in CHECKS.items():
        for g in (1, 3, 8):
            q, cache, meta = make_batch(requests, g * hkv, hkv, d, bs, dtype, gen)
            got = backend.forward(q, cache, meta).float()
            want = reference(q, cache, meta)
            err = ((got - want).norm() / want.norm()).item()
            results["checks"].append({"batch": kind, "group": g, "rel_error": err, "ok": err < 1e-2})
            print(f"check {kind:8s} G={g}: rel error {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
    save()

    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bandwidth / 1e6
    for name, requests in TIMINGS.items():
        q, cache, meta = make_batch(requests, args.group * hkv, hkv, d, bs, dtype, gen)
        reqs = per_request(q, cache, meta)
        qp, kp, vp, mask = padded(q, cache, meta)
        row = {
            "batch": name,
            "tokens": q.shape[0],
            "kernel_ms": time_ms(lambda: backend.forward(q, cache, meta), args.iters),
            "sdpa_per_request_ms": time_ms(
                lambda: [F.scaled_dot_product_attention(a, b, c, **m, enable_gqa=True) for a, b, c, m in reqs],
                args.iters,
            ),
            "sdpa_padded_ms": time_ms(
                lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True), args.iters
            ),
        }
        kv_bytes = sum(meta.context_lens_cpu) * hkv * d * 2 * cache.element_size()
        row["floor_ms"] = kv_bytes / bandwidth
        row["kernel_over_floor"] = row["kernel_ms"] / row["floor_ms"]  # eager: Python and launches included
        if all(n == 1 for n in meta.query_lens_cpu):
            try:
                row["graph_kernel_ms"] = graph_time_ms(backend, q, cache, meta, args.graph_iters)
                row["graph_over_floor"] = row["graph_kernel_ms"] / row["floor_ms"]
            except Exception as e:  # never run on a GPU yet: a failed capture must not cost the other rows
                row["graph_error"] = f"{type(e).__name__}: {e}"
        results["timings"].append(row)
        save()
        print(
            f"{name}: eager {row['kernel_ms']:.3f} ms, graph {row.get('graph_kernel_ms', float('nan')):.3f} ms, "
            f"floor {row['floor_ms']:.3f} ms {row.get('graph_error', '')}",
            flush=True,
        )

    results["variants"] = {}
    for spec in args.variant:
        results["variants"][spec] = row = variant(CudaAttention, spec, args, gen)
        save()
        print(
            f"variant {spec}: checks {'ok' if row['ok'] else 'FAIL'}; graph ms "
            + ", ".join(f"{k} {v:.3f}" for k, v in row["graph_kernel_ms"].items()),
            flush=True,
        )

    results["complete"] = True
    save()
    print(
        f"\n{results['device']}, {args.dtype}, D={d}, Hkv={hkv}, G={args.group}, "
        f"copy bandwidth {bandwidth / 1e6:.0f} GB/s; floor = K/V bytes / that bandwidth; graph = the kernel alone "
        f"(forward_decode in a CUDA graph), eager = the backend's whole call from Python"
    )
    print(
        f"{'batch':20s} {'eager ms':>9s} {'graph ms':>9s} {'sdpa/req ms':>12s} {'sdpa pad ms':>12s} {'floor ms':>9s} "
        f"{'eager/fl':>9s} {'graph/fl':>9s}"
    )
    for r in results["timings"]:
        graph = f"{r['graph_kernel_ms']:9.3f}" if "graph_kernel_ms" in r else f"{'':9s}"
        ratio = f"{r['graph_over_floor']:9.2f}" if "graph_over_floor" in r else f"{'':9s}"
        print(
            f"{r['batch']:20s} {r['kernel_ms']:9.3f} {graph} {r['sdpa_per_request_ms']:12.3f} "
            f"{r['sdpa_padded_ms']:12.3f} {r['floor_ms']:9.3f} {r['kernel_over_floor']:9.2f} {ratio}"
        )
    ok = (
        all(c["ok"] for c in results["checks"])
        and not any("graph_error" in r for r in results["timings"])
        and all(v["ok"] for v in results["variants"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
