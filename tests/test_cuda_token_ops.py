"""RoPE and the K/V cache write, and RMSNorm with its residual add, as CUDA kernels (engine/model/cuda_token_ops.py):
on the CPU, the custom ops Inductor calls and the module swaps; with --gpu, the kernels against the PyTorch formulas."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from engine.model import cuda_token_ops
from engine.model.cuda_token_ops import (
    CudaRMSNorm,
    CudaRotary,
    cuda_norm_available,
    cuda_rope_available,
    use_cuda_rms_norm,
    use_cuda_rotary,
)
from engine.model.token_ops import RMSNorm, Rotary

D, BLOCKS, BLOCK_SIZE = 64, 16, 16


def case(dtype, rows, heads, kv_heads, strided, d=D, device="cpu", seed=0):
    """A QKV [rows, (heads + 2 kv_heads) d] (rows strided if asked), positions, distinct slots, a random cache."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d + 8 * strided, generator=gen).mul(3).to(dtype)
    qkv = qkv[:, : (heads + 2 * kv_heads) * d]  # a view of a wider output, as the projection's may be
    positions = torch.randint(0, 500, (rows,), generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:rows]
    cache = torch.randn(2, kv_heads, BLOCKS, BLOCK_SIZE, d, generator=gen).to(dtype)
    return [on(device, t) for t in (qkv, positions, cache, slots)]


def on(device, t: torch.Tensor) -> torch.Tensor:
    """t on `device` with its strides (`.to` makes a row-strided view contiguous)."""
    if t.dim() != 2 or t.is_contiguous():
        return t.to(device)
    out = torch.empty(t.shape[0], t.stride(0), dtype=t.dtype, device=device)[:, : t.shape[1]]
    return out.copy_(t)


def swapped(rotary: Rotary) -> CudaRotary:
    model = torch.nn.Sequential(rotary)
    use_cuda_rotary(model)
    return model[0]


def formula(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads):
    """The op's contract through the PyTorch formula: queries returned dense, the cache written in place."""
    rotary = Rotary.__new__(Rotary)
    torch.nn.Module.__init__(rotary)
    rotary.register_buffer("table", table, persistent=False)
    return rotary.rope_write_kv(qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads).contiguous()


def test_compiled_code_calls_the_op_on_the_cache_itself(monkeypatch):
    """Inductor must hand the op the cache argument, not a copy (a copy of a GPU cache is GiBs a layer), and take
    its fake's shapes (a dense [T, Hq, D]): checked on the CPU with the formula standing in for the kernel."""
    monkeypatch.setattr(cuda_token_ops, "launcher", lambda: formula)
    rotary = Rotary(D, 10000.0, 512)
    weight = torch.randn(32, 8 * D)

    def layer(x, positions, cache, slots):
        q = torch.ops.orcinus.rope_write_kv(x @ weight, positions, rotary.table, cache, slots, 4, 2)
        return q * 2

    x = torch.randn(5, 32)
    _, positions, cache, slots = case(torch.float32, 5, 4, 2, False)
    want_cache = cache.clone()
    want = layer(x, positions, want_cache, slots)
    torch._dynamo.reset()
    with torch.inference_mode():
        got, codes = run_and_get_code(torch.compile(layer, dynamic=True), x, positions, cache, slots)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, want_cache)
    call = [line for code in codes for line in code.splitlines() if "orcinus.rope_write_kv.default(" in line]
    assert len(call) == 1
    cache_arg = call[0].split("(")[1].split(",")[3].strip()
    assert cache_arg.startswith("arg"), call[0]  # the graph input itself
    assert not any(f"{cache_arg}.copy_" in code or f"copy_({cache_arg}" in code for code in codes)


def test_every_rotary_is_swapped_and_shared_tables_stay_shared():
    shared, other = Rotary(D, 10000.0, 64), Rotary(D, 500000.0, 64)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(shared, other)})
    use_cuda_rotary(model)
    assert type(model["a"]) is CudaRotary and model["a"] is model["b"][0]
    assert model["a"].table is shared.table and model["b"][1].table is other.table


def test_cpu_tensors_take_the_formula():
    qkv, positions, cache, slots = case(torch.bfloat16, 7, 4, 2, True)
    rotary = Rotary(D, 10000.0, 512).to(torch.bfloat16)
    want_cache = cache.clone()
    want = rotary.rope_write_kv(qkv, positions, want_cache, slots, 4, 2)
    got = swapped(rotary).rope_write_kv(qkv, positions, cache, slots, 4, 2)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)


def test_no_gpu_means_no_kernel():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    assert not cuda_rope_available() and not cuda_norm_available()


def norm_formula(x, residual, weight, eps):
    """The norm op's contract through the PyTorch module: (residual + x or None, the normed rows)."""
    norm = RMSNorm.__new__(RMSNorm)
    torch.nn.Module.__init__(norm)
    norm.weight, norm.eps = torch.nn.Parameter(weight, requires_grad=False), eps
    return (None, norm(x)) if residual is None else norm(x, residual)


def test_compiled_code_calls_the_norm_ops(monkeypatch):
    """Inside a compiled segment the norms are op boundaries that Inductor calls (and takes their fakes' shapes):
    checked on the CPU with the PyTorch module standing in for the kernel."""
    monkeypatch.setattr(cuda_token_ops, "norm_launcher", lambda: norm_formula)
    weight = torch.randn(48)

    def layer(x, residual):
        total, h = torch.ops.orcinus.add_rms_norm(x * 2, residual, weight, 1e-6)
        return total + torch.ops.orcinus.rms_norm(h, weight, 1e-6)

    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    want_total, want_h = norm_formula(x * 2, residual, weight, 1e-6)
    want = want_total + norm_formula(want_h, None, weight, 1e-6)[1]
    torch._dynamo.reset()
    with torch.inference_mode():
        got, codes = run_and_get_code(torch.compile(layer, dynamic=True), x, residual)
    torch.testing.assert_close(got, want)
    calls = [
        line
        for code in codes
        for line in code.splitlines()
        if "orcinus.add_rms_norm.default(" in line or "orcinus.rms_norm.default(" in line
    ]
    assert len(calls) == 2, codes


def test_every_norm_is_swapped_sharing_its_weight_and_cpu_tensors_take_pytorchs_path():
    norms = [RMSNorm(48, 1e-6) for _ in range(2)]
    model = torch.nn.Sequential(norms[0], torch.nn.Sequential(norms[1]))
    use_cuda_rms_norm(model)
    assert type(model[0]) is CudaRMSNorm and type(model[1][0]) is CudaRMSNorm
    assert model[0].weight is norms[0].weight and model[1][0].eps == norms[1].eps
    x, residual = torch.randn(3, 48), torch.randn(3, 48)
    assert torch.equal(model[0](x), norms[0](x))
    assert all(map(torch.equal, model[0](x, residual), norms[0](x, residual)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (5, 96), (64, 576), (3, 8192), (2, 257)])
def test_the_norm_kernel_against_pytorch(dtype, rows, hidden):
    """The residual's sum bit for bit; the output within a last place of PyTorch's (the mean's sums in another
    order); eager and compiled calls of the swapped module alike."""
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    x, residual = (torch.randn(rows, hidden, generator=gen).mul(3).to(dtype) for _ in range(2))
    (want_total, want), want_plain = norm(x, residual), norm(x)
    assert cuda_norm_available()
    fused = torch.nn.Sequential(norm)
    use_cuda_rms_norm(fused)
    fused = fused.cuda()[0]
    got_total, got = fused(x.cuda(), residual.cuda())
    assert torch.equal(got_total.cpu(), want_total)
    tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5  # two last places: relative, any size
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=1e-5)
    torch.testing.assert_close(fused(x.cuda()).cpu(), want_plain, rtol=tol, atol=1e-5)
    torch._dynamo.reset()
    with torch.inference_mode():
        compiled = torch.compile(lambda a, b: fused(a, b), dynamic=True)(x.cuda(), residual.cuda())
    assert torch.equal(compiled[0], got_total) and torch.equal(compiled[1], got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows,heads,kv_heads,d,strided",
    [(1, 32, 8, 64, False), (7, 4, 4, 128, True), (200, 8, 2, 64, True), (3, 14, 2, 128, False)],
)
def test_the_kernel_gives_the_formulas_bits(dtype, rows, heads, kv_heads, d, strided):
    qkv, positions, cache, slots = case(dtype, rows, heads, kv_heads, strided, d, seed=rows)
    rotary = Rotary(d, 10000.0, 512).to(dtype)
    want_cache = cache.clone()
    want = rotary.rope_write_kv(qkv, positions, want_cache, slots, heads, kv_heads)
    assert cuda_rope_available()
    fused = swapped(Rotary(d, 10000.0, 512).to(dtype)).cuda()
    got_cache = cache.cuda()
    gpu_qkv = on("cuda", qkv)
    assert gpu_qkv.stride() == qkv.stride()
    got = fused.rope_write_kv(gpu_qkv, positions.cuda(), got_cache, slots.cuda(), heads, kv_heads)
    assert got.is_contiguous() and torch.equal(got.cpu(), want)
    assert torch.equal(got_cache.cpu(), want_cache)  # keys and values in their slots, nothing else touched


@pytest.mark.gpu
def test_negative_slots_write_nothing_and_compiled_calls_match_eager():
    qkv, positions, cache, slots = case(torch.bfloat16, 9, 8, 2, True, device="cuda")
    slots[3] = -1
    fused = swapped(Rotary(D, 10000.0, 512).to(torch.bfloat16)).cuda()
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = fused.rope_write_kv(qkv, positions, eager_cache, slots, 8, 2)
    keep = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    keep[slots[slots >= 0]] = False
    assert torch.equal(eager_cache.view(2, 2, -1, D)[:, :, keep], cache.view(2, 2, -1, D)[:, :, keep])
    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(fused.rope_write_kv, dynamic=True)(qkv, positions, compiled_cache, slots, 8, 2)
    assert torch.equal(got, want) and torch.equal(compiled_cache, eager_cache)
