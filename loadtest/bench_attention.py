"""Check and time the CUDA attention backend (engine/attention/cupy_backend.py) on a GPU.

    python loadtest/bench_attention.py --out benchmarks/attention.json

(a) correctness: fresh random ragged batches (prefill-only, decode-only, mixed; GQA 1, 3, 8; lengths
    1..8192 incl. block boundaries) against float32 SDPA per request, by relative error;
(b) speed: the backend's whole attention call (the decode kernel, SDPA for prefill chunks, and the
    cache write) vs torch SDPA on the same work (one call per request on pre-gathered K/V, and one
    padded-batch call with a mask), and for decode vs the floor = K/V bytes / copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention.backend import AttentionMetadata  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def make_batch(requests, hq, hkv, d, bs, dtype, gen):
    """requests: (n new tokens, ctx) pairs; cache blocks are placed at random."""
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
    meta = AttentionMetadata(qsl.cuda(), torch.tensor([c for _, c in requests], dtype=torch.int32).cuda(),
                             tables.cuda(), torch.cat(slots).cuda(), [n for n, _ in requests], [c for _, c in requests])
    return q, k, v, cache, meta


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
    outs = [F.scaled_dot_product_attention(qq.float(), kk.float(), vv.float(), **m, enable_gqa=True)
            for qq, kk, vv, m in per_request(q, cache, meta)]
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
    "decode 1x8192": [(1, 8192)], "decode 8x2048": [(1, 2048)] * 8, "decode 64x2048": [(1, 2048)] * 64,
    "decode 256x512": [(1, 512)] * 256, "decode 16x8192": [(1, 8192)] * 16,
    "prefill 4x1024": [(1024, 1024)] * 4, "mixed 2x512+62 dec": [(512, 512)] * 2 + [(1, 1024)] * 62,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head for the timings")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    from engine.attention.cupy_backend import CudaAttention  # needs CuPy and a GPU; import after --help

    backend, dtype, gen = CudaAttention(), DTYPES[args.dtype], torch.Generator().manual_seed(0)
    d, hkv, bs = args.head_dim, args.kv_heads, args.block_size
    results = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "checks": [], "timings": []}

    for kind, requests in CHECKS.items():
        for g in (1, 3, 8):
            q, k, v, cache, meta = make_batch(requests, g * hkv, hkv, d, bs, dtype, gen)
            got = backend.forward(q, k, v, cache, meta).float()
            want = reference(q, cache, meta)
            err = ((got - want).norm() / want.norm()).item()
            results["checks"].append({"batch": kind, "group": g, "rel_error": err, "ok": err < 1e-2})
            print(f"check {kind:8s} G={g}: rel error {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}")

    bandwidth = copy_bandwidth()
    for name, requests in TIMINGS.items():
        q, k, v, cache, meta = make_batch(requests, args.group * hkv, hkv, d, bs, dtype, gen)
        backend.forward(q, k, v, cache, meta)  # the cache now holds this batch's K/V too
        reqs = per_request(q, cache, meta)
        qp, kp, vp, mask = padded(q, cache, meta)
        row = {"batch": name, "tokens": q.shape[0],
               "kernel_ms": time_ms(lambda: backend.forward(q, k, v, cache, meta), args.iters),
               "sdpa_per_request_ms": time_ms(lambda: [F.scaled_dot_product_attention(
                   a, b, c, **m, enable_gqa=True) for a, b, c, m in reqs], args.iters),
               "sdpa_padded_ms": time_ms(lambda: F.scaled_dot_product_attention(
                   qp, kp, vp, attn_mask=mask, enable_gqa=True), args.iters)}
        kv_bytes = sum(meta.context_lens_cpu) * hkv * d * 2 * cache.element_size()
        row["floor_ms"] = kv_bytes / bandwidth
        row["kernel_over_floor"] = row["kernel_ms"] / row["floor_ms"]
        results["timings"].append(row)

    results["copy_bandwidth_GBps"] = bandwidth / 1e6
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    print(f"\n{results['device']}, {args.dtype}, D={d}, Hkv={hkv}, G={args.group}, "
          f"copy bandwidth {bandwidth / 1e6:.0f} GB/s; floor = K/V bytes / that bandwidth")
    print(f"{'batch':20s} {'backend ms':>10s} {'sdpa/req ms':>12s} {'sdpa pad ms':>12s} {'floor ms':>9s} "
          f"{'x floor':>8s}")
    for r in results["timings"]:
        print(f"{r['batch']:20s} {r['kernel_ms']:10.3f} {r['sdpa_per_request_ms']:12.3f} {r['sdpa_padded_ms']:12.3f} "
              f"{r['floor_ms']:9.3f} {r['kernel_over_floor']:8.2f}")
    return 0 if all(c["ok"] for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
