"""Per-layer attention parameters (AttentionParams: softmax scale, sliding window, logit soft cap) in every backend:
each matches a float64 brute force, and keys before a sliding window are never read (their blocks are poisoned)."""

import pytest
import torch
from test_cuda_kernels import needs_gpu, ragged_batch, rel_error

from engine.attention.backend import AttentionParams
from engine.attention.cpu_backend import CpuAttention
from engine.attention.torch_backend import TorchAttention
from engine.attention.varlen_prefill import PrefillPlan, attend_prefills, reference_varlen

BATCH = [(1, 1), (1, 40), (1, 97), (17, 17), (40, 97), (1, 300), (5, 33)]
PARAMS = {
    "plain": AttentionParams.plain(64),
    "scale": AttentionParams(0.3),
    "window-8": AttentionParams(0.125, sliding_window=8),
    "window-33": AttentionParams(0.125, sliding_window=33),
    "softcap": AttentionParams(0.125, logit_softcap=2.0),
    "window-softcap": AttentionParams(0.125, sliding_window=20, logit_softcap=3.0),
}


def brute_force(q, cache, meta, params):
    """Every query against every key it may see, in float64, one at a time."""
    q, cache = q.double(), cache.double()
    num_kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for i, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        slots = [int(meta.block_tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx)]
        keys = cache[0].reshape(num_kv_heads, -1, cache.shape[4])[:, slots]  # [Hkv, ctx, D]
        values = cache[1].reshape(num_kv_heads, -1, cache.shape[4])[:, slots]
        for j in range(n):
            row, pos = meta.query_starts_cpu[i] + j, ctx - n + j
            seen = [k for k in range(pos + 1) if not params.sliding_window or k > pos - params.sliding_window]
            for h in range(q.shape[1]):
                s = keys[h // group, seen] @ q[row, h] * params.scale
                if params.logit_softcap:
                    s = params.logit_softcap * torch.tanh(s / params.logit_softcap)
                out[row, h] = s.softmax(0) @ values[h // group, seen]
    return out


def poison_before_windows(cache, meta, params):
    """Point every table entry wholly before a request's window at a block of NaNs: a backend that reads it fails."""
    if not params.sliding_window:
        return cache, meta
    block_size = cache.shape[3]
    cache = torch.cat([cache, torch.full_like(cache[:, :, :1], float("nan"))], dim=2)
    tables = meta.block_tables.clone()
    for i, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        first = max(0, ctx - n + 1 - params.sliding_window)  # the earliest key any of its queries sees
        tables[i, : first // block_size] = cache.shape[2] - 1
    meta.block_tables = tables
    return cache, meta


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_reference_and_the_cpu_op_match_brute_force(name):
    params = PARAMS[name]
    q, cache, meta = ragged_batch(BATCH, 6, 2, 64, dtype=torch.float32, device="cpu")
    want = brute_force(q, cache, meta, params)
    cache, meta = poison_before_windows(cache, meta, params)
    for backend in (TorchAttention(), CpuAttention()):
        got = backend.forward(q, cache, meta, params)
        assert not got.isnan().any(), type(backend).__name__
        assert rel_error(got, want) < 1e-5, type(backend).__name__


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_varlen_plan_gathers_only_the_window_and_matches(name):
    params = PARAMS[name]
    q, cache, meta = ragged_batch(BATCH, 6, 2, 64, dtype=torch.float32, device="cpu")
    want = brute_force(q, cache, meta, params)
    cache, meta = poison_before_windows(cache, meta, params)
    plan = PrefillPlan.build(meta, cache.shape[3], params.sliding_window)
    if params.sliding_window:  # (40, 97) sees keys from 97 - 40 + 1 - window on
        assert plan.cu_keys.tolist()[-1] < sum(c for n, c in BATCH if n > 1)
    got = torch.full_like(q, float("nan"))
    attend_prefills(q, cache, plan, got, reference_varlen, params)
    assert rel_error(got[plan.rows], want[plan.rows]) < 1e-5


def test_first_key_of_a_window():
    assert AttentionParams(1.0, sliding_window=4).first_key(10) == 6  # keys 6..9: four, the query's own included
    assert AttentionParams(1.0, sliding_window=40).first_key(10) == 0
    assert AttentionParams(1.0).first_key(10) == 0


@needs_gpu
@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_cuda_kernel_and_flash_prefill_match_brute_force(name, dtype):
    from engine.attention.cuda_backend import CudaAttention

    params = PARAMS[name]
    batch = BATCH + [(1, 2049), (1, 5000), (64, 700)]
    q, cache, meta = ragged_batch(batch, 8, 2, 64, dtype=dtype, device="cpu")
    want = brute_force(q, cache, meta, params)
    cache, meta = poison_before_windows(cache, meta, params)
    backend = CudaAttention()
    got = backend.forward(q.cuda(), cache.cuda(), meta.to("cuda"), params)
    assert not got.isnan().any()
    assert rel_error(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
