"""The fused CPU token ops (engine/kernels/csrc/cpu/token_ops.cpp): RMSNorm, residual add + RMSNorm, SiLU-and-multiply
and RoPE with the K/V cache write give PyTorch's results (float32 to rounding, bfloat16 to the bit but for rare
last-place differences); they replace the modules in bfloat16 CPU models only, sharing their weights; a machine that
cannot build them keeps PyTorch's ops with a warning."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.model import token_ops
from engine.model.token_ops import (
    CpuRMSNorm,
    CpuRotary,
    CpuSiluAndMul,
    RMSNorm,
    Rotary,
    SiluAndMul,
    can_fuse,
    fuse_token_ops,
)

SHAPES = [(1, 576), (3, 7), (32, 576), (600, 64), (5, 2048)]  # odd widths exercise the vector loops' tails
BF16_ULP = 2.0**-7  # relative spacing of bfloat16


def close(got, want, dtype, ulps=1):
    """float32: to rounding. bfloat16: a differing element is rare and off by at most `ulps` in the last place."""
    if dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    differ = got != want
    return differ.float().mean() < 1e-2 and bool(((got - want).abs() <= want.abs() * ulps * BF16_ULP)[differ].all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_the_fused_norms_give_pytorchs(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, residual = (torch.randn(rows, hidden, generator=gen).mul(3).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ref, fused = RMSNorm(hidden, 1e-5), CpuRMSNorm(hidden, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(weight)
        fused.weight.copy_(weight)
    ref, fused = ref.to(dtype), fused.to(dtype)
    assert close(fused(x), F.rms_norm(x, (hidden,), weight, 1e-5), dtype)
    (got_sum, got), (want_sum, want) = fused(x, residual), ref(x, residual)
    assert torch.equal(got_sum, residual + x)  # the residual add rounds exactly as PyTorch's add does
    assert torch.equal(want_sum, residual + x) and close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", SHAPES)
def test_the_fused_activation_gives_pytorchs(dtype, rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)).mul(4).to(dtype)
    # silu's exp differs from PyTorch's in the last bit now and then; rounded to bfloat16, then multiplied by up,
    # that is at most two units in the last place of the product.
    assert close(CpuSiluAndMul()(gate_up), SiluAndMul()(gate_up), dtype, ulps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,strided", [(1, 9, 3, False), (7, 4, 4, True), (40, 8, 2, False)])
def test_the_fused_rope_and_cache_write_give_pytorchs_bits(dtype, rows, heads, kv_heads, strided):
    gen = torch.Generator().manual_seed(rows * heads)
    d, blocks, block_size = 64, 6, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d + 8 * strided, generator=gen).mul(3).to(dtype)
    qkv = qkv[:, : (heads + 2 * kv_heads) * d]  # rows strided, as a view of a wider output would be
    positions = torch.randint(0, 500, (rows,), generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    rotary = Rotary(d, 10000.0, 512).to(dtype)
    fused = CpuRotary.__new__(CpuRotary)
    torch.nn.Module.__init__(fused)
    fused.register_buffer("table", rotary.table, persistent=False)
    caches = [torch.randn(2, kv_heads, blocks, block_size, d, generator=gen).to(dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    want = rotary.rope_write_kv(qkv, positions, caches[0], slots, heads, kv_heads)
    got = fused.rope_write_kv(qkv, positions, caches[1], slots, heads, kv_heads)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(caches[1], caches[0])  # rotated keys and the values in their slots, nothing else touched


def test_what_the_ops_cannot_take_goes_to_pytorch_or_is_refused():
    x = torch.randn(4, 8, 16)  # 3-d: the module hands it to PyTorch
    norm = CpuRMSNorm(16, 1e-6)
    assert torch.equal(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6))
    strided = torch.randn(16, 6)[:, :3]
    assert torch.equal(CpuSiluAndMul()(strided.t()), SiluAndMul()(strided.t()))
    ops = token_ops._ops()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="x and residual must match"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="side by side"):
        ops.silu_mul(torch.randn(2, 7))
    table, cache = Rotary(8, 10000.0, 4).table, torch.zeros(2, 1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="out of range"):  # a position past the table, or a slot past the cache
        ops.rope_write_kv(torch.randn(1, 24), torch.tensor([4]), table, cache, torch.tensor([0]), 1, 1)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_write_kv(torch.randn(1, 24), torch.tensor([0]), table, cache, torch.tensor([8]), 1, 1)


def test_bfloat16_cpu_models_get_the_fused_ops_and_float32_keeps_pytorchs(checkpoint):
    bf16 = LLM(checkpoint=checkpoint, dtype="bfloat16").engine.model
    layer = bf16.layers[0]
    assert type(layer.input_layernorm) is type(layer.post_attention_layernorm) is type(bf16.norm) is CpuRMSNorm
    assert type(layer.act) is CpuSiluAndMul
    assert type(layer.rotary) is CpuRotary and layer.rotary is bf16.layers[1].rotary  # still one shared table
    assert layer.input_layernorm.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight is dict(bf16.named_parameters())["layers.0.input_layernorm.weight"]
    fp32 = LLM(checkpoint=checkpoint, dtype="float32", weights="dense").engine.model  # the reference (blocks fuse)
    assert type(fp32.norm) is RMSNorm and type(fp32.layers[0].act) is SiluAndMul
    assert not can_fuse(torch.device("cuda"), torch.bfloat16) and not can_fuse(torch.device("cpu"), torch.float32)


def test_a_machine_that_cannot_build_them_keeps_pytorchs_ops(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension 'orcinus_cpu_token_ops'")

    monkeypatch.setattr(token_ops, "_ops", no_compiler)
    with pytest.warns(UserWarning, match="fused CPU token ops are unusable here"):
        assert not can_fuse(torch.device("cpu"), torch.bfloat16)
    model = torch.nn.Sequential(RMSNorm(8, 1e-6), SiluAndMul(), Rotary(8, 10000.0, 4))
    fuse_token_ops(model)  # swapping needs no build; can_fuse is what build_model asks first
    assert [type(m) for m in model] == [CpuRMSNorm, CpuSiluAndMul, CpuRotary]


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 9, 3, 64), (32, 14, 2, 64), (5, 4, 1, 256)])
def test_the_fused_rope_writes_a_16_bit_cache_under_float32_with_pytorchs_bits(cache_dtype, rows, heads, kv_heads, d):
    """--kv-cache-dtype (float16 by default on the CPU): float32 queries and keys rotated as PyTorch rotates them, the
    keys and values rounded to nearest even into the 16-bit cache as .to() rounds them; the fused pass takes it."""
    gen = torch.Generator().manual_seed(rows * heads + d)
    blocks, block_size = 6, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).mul(3)
    qkv[0, :8] = torch.tensor(
        [1e-6, -7e-5, 65519.0, 70000.0, 2.0**-24 * 1.5, 0.0, -0.0, 3.0e-8]
    )  # subnormals, overflow
    positions = torch.randint(0, 500, (rows,), generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    rotary = Rotary(d, 10000.0, 512)
    fused = rotary.on_table_of(CpuRotary)
    caches = [torch.randn(2, kv_heads, blocks, block_size, d, generator=gen).to(cache_dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    assert fused._takes(qkv, positions, caches[1], slots)
    want = rotary.rope_write_kv(qkv, positions, caches[0], slots, heads, kv_heads)
    got = fused.rope_write_kv(qkv, positions, caches[1], slots, heads, kv_heads)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(caches[1].view(torch.int16), caches[0].view(torch.int16))  # bit for bit, signed zeros too
