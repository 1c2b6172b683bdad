"""All prefill chunks of a step in one variable-length attention call (engine/attention/varlen_prefill.py):
the gather plan and the packing around the call give, with the reference in place of flash attention, what
one SDPA per request gives, on the CPU; on a GPU (`pytest --gpu`) flash attention itself is checked."""

import pytest
import torch
from test_cuda_kernels import BATCHES, MIXED, needs_gpu, ragged_batch, reference, rel_error

from engine.attention.backend import AttentionParams
from engine.attention.torch_backend import attend_prefill
from engine.attention.varlen_prefill import PrefillPlan, attend_prefills, reference_varlen

# (new queries, context): whole prompts, chunks after a cached prefix, decodes (not in the plan), block edges.
CASES = {**BATCHES, "chunks": [(40, 97), (1, 5), (16, 48), (2, 2), (1, 1), (33, 65), (15, 15)]}


def per_request(q, cache, meta, params=None):
    out = torch.full_like(q, float("nan"))
    for i, n in enumerate(meta.query_lens_cpu):
        if n > 1:
            attend_prefill(q, cache, meta, i, meta.query_starts_cpu, out, params or AttentionParams.plain(q.shape[-1]))
    return out


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["g1", "g3", "g8"])
def test_one_call_for_all_chunks_gives_each_requests_own_attention(kind, heads):
    q, cache, meta = ragged_batch(CASES[kind], *heads, head_dim=32, dtype=torch.float32, device="cpu")
    want = per_request(q, cache, meta)
    plan = PrefillPlan.build(meta, cache.shape[3])
    prefills = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
    if not prefills:
        assert plan is None
        return
    starts = meta.query_starts_cpu
    assert plan.rows.tolist() == [r for i in prefills for r in range(starts[i], starts[i + 1])]
    assert plan.cu_keys.tolist()[-1] == len(plan.slots) == sum(meta.context_lens_cpu[i] for i in prefills)
    assert plan.max_queries == max(meta.query_lens_cpu[i] for i in prefills)
    got = torch.full_like(q, float("nan"))
    attend_prefills(q, cache, plan, got, reference_varlen, AttentionParams.plain(32))
    rows = plan.rows
    assert torch.allclose(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    others = torch.ones(len(q), dtype=torch.bool)
    others[rows] = False
    assert got[others].isnan().all()  # decode rows are the decode kernel's: left alone


def test_the_plan_reads_each_context_token_from_its_own_slot():
    block_size = 4
    meta = ragged_batch([(1, 3), (6, 6), (2, 9)], 2, 1, 8, block_size=block_size, dtype=torch.float32, device="cpu")[2]
    plan = PrefillPlan.build(meta, block_size)
    t = meta.block_tables
    want = [int(t[i, p // block_size]) * block_size + p % block_size for i, ctx in ((1, 6), (2, 9)) for p in range(ctx)]
    assert plan.slots.tolist() == want
    assert plan.cu_queries.tolist() == [0, 6, 8] and plan.cu_keys.tolist() == [0, 6, 15]
    assert plan.cu_queries.dtype == plan.cu_keys.dtype == torch.int32


def test_the_cuda_backend_plans_once_per_step_and_falls_back_to_sdpa_if_flash_fails(monkeypatch):
    from engine.attention import cuda_backend

    backend = object.__new__(cuda_backend.CudaAttention)  # its dispatch alone: __init__ wants a GPU
    backend.prefill_kernel, backend._plan_meta, backend._plans = "flash", None, {}
    builds = []
    build = PrefillPlan.build
    monkeypatch.setattr(cuda_backend.PrefillPlan, "build", lambda *a: builds.append(a) or build(*a))
    monkeypatch.setattr(cuda_backend, "flash_varlen", reference_varlen)
    q, cache, meta = ragged_batch(CASES["chunks"], 6, 2, head_dim=32, dtype=torch.bfloat16, device="cpu")
    want = per_request(q, cache, meta)
    rows = build(meta, cache.shape[3]).rows
    for _ in range(3):  # three layers of one step
        got = torch.full_like(q, float("nan"))
        backend._attend_prefills(q, cache, meta, got, AttentionParams.plain(32))
        assert torch.allclose(got[rows].float(), want[rows].float(), atol=2e-2)
    assert len(builds) == 1 and backend.prefill_kernel == "flash"

    def unusable(*args):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(cuda_backend, "flash_varlen", unusable)
    got = torch.full_like(q, float("nan"))
    with pytest.warns(UserWarning, match="prefills go one SDPA each: FlashAttention only supports"):
        backend._attend_prefills(q, cache, meta, got, AttentionParams.plain(32))
    assert backend.prefill_kernel == "sdpa" and torch.equal(got[rows], want[rows])


@needs_gpu
@pytest.mark.parametrize("kind", ["prefill", "mixed", "long-prefill", "chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_takes_every_chunk_at_once_on_a_gpu(kind, dtype):
    from engine.attention.cuda_backend import CudaAttention

    q, cache, meta = ragged_batch(CASES[kind], 32, 8, head_dim=128, dtype=dtype)
    want = reference(q, cache, meta)
    backend = CudaAttention()
    got = backend.forward(q, cache, meta)
    torch.cuda.synchronize()
    assert backend.prefill_kernel == "flash"  # not fallen back to one SDPA per request
    assert rel_error(got, want) < 1e-2


@needs_gpu
def test_float32_prefills_go_one_sdpa_each_and_match():
    from engine.attention.cuda_backend import CudaAttention

    q, cache, meta = ragged_batch(MIXED, 8, 2, head_dim=64, dtype=torch.float32)
    want = reference(q, cache, meta)
    assert rel_error(CudaAttention().forward(q, cache, meta), want) < 1e-4
