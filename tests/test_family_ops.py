"""The fused CPU ops some families choose (engine/kernels/csrc/cpu/family_ops.cpp): GeGLU's GELU(tanh)-and-multiply,
Gemma 2's final logit soft cap, and Gemma 3's per-head query/key RMSNorm fused with RoPE and the K/V write, against the
PyTorch expressions they replace; the modules a family builds pick them, and a fused bfloat16 model greedy-decodes as
the unfused one."""

import pytest
import torch
import torch.nn.functional as F
from test_families import GEMMA2, GEMMA3, PROMPTS, build

from engine import LLM, SamplingParams
from engine.model import token_ops
from engine.model.token_ops import (
    CpuGeluAndMul,
    CpuHeadRMSNorm,
    CpuLogitSoftCap,
    CpuRMSNorm,
    CpuRotary,
    GeluAndMul,
    HeadRMSNorm,
    LogitSoftCap,
    Rotary,
    fuse_token_ops,
)

SHAPES = [(1, 2048), (3, 7), (32, 576), (5, 9216), (2, 1)]  # odd widths exercise the vector loops' tails


@pytest.mark.parametrize("rows,width", SHAPES)
def test_geglu_is_pytorchs_bits_in_bfloat16_but_where_the_gelu_is_below_1e_6(rows, width):
    """Bit-equal: the op computes PyTorch's float32 formula and rounds where it rounds. The exception is the far
    negative tail, where 1 + tanh(u) is a few float32 ulps above 0 and Sleef's tanh and ours differ by one of
    them (PyTorch's own scalar and vector paths disagree there too): both values are then below 1e-6 times |up|."""
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)).mul(4).bfloat16()
    got, want = CpuGeluAndMul()(gate_up), GeluAndMul()(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    differ = got != want
    assert bool((gate[differ] < -4.5).all())
    assert bool(((got.float() - want.float()).abs() <= 1e-6 * up.abs())[differ].all())
    assert differ.float().mean() < 0.01


def test_geglu_in_float32_is_pytorchs_to_tanhs_rounding():
    """float32 (block weights only): tanh's error near +-1 is absolute (2^-24), so 1 + tanh(u), hence the product,
    is within 2^-22 |gate * up| of PyTorch's, not within an ulp of it where gelu is small."""
    gate_up = torch.randn(64, 2 * 2051, generator=torch.Generator().manual_seed(1)).mul(4)
    got, want = CpuGeluAndMul()(gate_up), GeluAndMul()(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert bool(((got - want).abs() <= 2.0**-22 * (gate * up).abs() + 1e-6 * want.abs()).all())


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values apart a and b are (same-signed values)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.mark.parametrize("cap", [30.0, 3.0, 50.0])
@pytest.mark.parametrize("rows,vocab", [(1, 256_000), (3, 1001), (2, 7)])  # odd widths exercise the vector tails
def test_the_logit_soft_cap_is_pytorchs_bits_but_where_its_tanh_is_an_ulp_off(cap, rows, vocab):
    """The quotient and the product round as PyTorch's float32 ops do, the tanh between them is float32's correctly
    rounded one: bit-equal to PyTorch's formula with its tanh taken in float64. PyTorch's float32 tanh is itself an
    ulp off for a few values in 10^4; only there does the op differ from it, by at most 2 ulps once times the cap."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=gen).mul(1.5 * cap)
    logits[0, : min(vocab, 64)] = torch.linspace(-1e-4, 1e-4, min(vocab, 64))  # tanh's series near 0
    got = CpuLogitSoftCap(cap)(logits)
    q = logits / cap
    assert torch.equal(got, torch.tanh(q.double()).float() * cap)
    want = LogitSoftCap(cap)(logits)
    off = torch.tanh(q) != torch.tanh(q.double()).float()
    assert torch.equal(got[~off], want[~off])
    assert int(ulps(got, want).max()) <= 2 and off.float().mean() < 1e-3


def rope_case(dtype, rows, heads, kv_heads, d, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size = 6, 16
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(rows, width + 8 * strided, generator=gen).mul(3).to(dtype)[:, :width]
    positions = torch.randint(0, 500, (rows,), generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    rotary = Rotary(d, 10000.0, 512).to(dtype)
    norms = [HeadRMSNorm(d, 1e-6) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.normal_(1.0, 0.3, generator=gen)  # Gemma's 1 + w, as loaded
    norms = [n.to(dtype) for n in norms]
    cache = torch.randn(2, kv_heads, blocks, block_size, d, generator=gen).to(dtype)
    return qkv, positions, slots, rotary, norms, cache


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows,heads,kv_heads,strided", [(1, 4, 1, False), (2, 4, 1, True), (7, 9, 3, True)])
def test_qk_norm_rope_is_pytorchs_bits_in_bfloat16(d, rows, heads, kv_heads, strided):
    """Bit-equal in bfloat16: each head's norm rounds once to bfloat16 as F.rms_norm's does (its float32 statistics
    land on the same bfloat16), then RoPE is token_ops.cpp's, which is PyTorch's bits."""
    qkv, positions, slots, rotary, (qn, kn), cache = rope_case(torch.bfloat16, rows, heads, kv_heads, d, strided, d)
    fused = rotary.on_table_of(CpuRotary)
    cq, ck = qn.on_weight_of(CpuHeadRMSNorm), kn.on_weight_of(CpuHeadRMSNorm)
    caches = [cache.clone() for _ in range(3)]
    want = rotary.norm_rope_write_kv(qkv, qn, kn, positions, caches[0], slots, heads, kv_heads)
    got = fused.norm_rope_write_kv(qkv, cq, ck, positions, caches[1], slots, heads, kv_heads)
    # the C++ chain it replaces: two rms_norm calls, a cat, rope_write_kv
    chain = Rotary.norm_rope_write_kv(fused, qkv, cq, ck, positions, caches[2], slots, heads, kv_heads)
    assert got.is_contiguous() and torch.equal(got, want) and torch.equal(got, chain)
    assert torch.equal(caches[1], caches[0]) and torch.equal(caches[1], caches[2])


@pytest.mark.parametrize("d", [64, 256])
def test_qk_norm_rope_in_float32_is_pytorchs_to_rounding(d):
    """float32 (block weights only): the norm's sum of squares adds in another order, so to rounding, not bits."""
    qkv, positions, slots, rotary, (qn, kn), cache = rope_case(torch.float32, 5, 4, 1, d, True, 3)
    fused = rotary.on_table_of(CpuRotary)
    caches = [cache.clone() for _ in range(2)]
    want = rotary.norm_rope_write_kv(qkv, qn, kn, positions, caches[0], slots, 4, 1)
    got = fused.norm_rope_write_kv(
        qkv, qn.on_weight_of(CpuHeadRMSNorm), kn.on_weight_of(CpuHeadRMSNorm), positions, caches[1], slots, 4, 1
    )
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.allclose(
        caches[1], caches[0], rtol=1e-5, atol=1e-6
    )


def test_the_norm_alone_is_within_an_ulp_of_f_rms_norm():
    """With cos = 1, sin = 0 RoPE is the identity: what is left is the norm, against F.rms_norm on many heads."""
    d, heads, rows = 256, 8, 64
    qkv, _, slots, _, (qn, kn), cache = rope_case(torch.bfloat16, rows, heads, heads, d, False, 5)
    table = torch.zeros(1, 2, d, dtype=torch.bfloat16)
    table[:, 0] = 1
    q = token_ops._family_ops().qk_norm_rope_write_kv(
        qkv, torch.zeros(rows, dtype=torch.int64), table, cache, slots, heads, heads, qn.weight, kn.weight, 1e-6
    )
    want = F.rms_norm(qkv[:, : heads * d].reshape(rows, heads, d), (d,), qn.weight, 1e-6)
    differ = q != want
    assert bool(((q.float() - want.float()).abs() <= want.float().abs() * 2.0**-7)[differ].all())


def test_what_the_ops_cannot_take_is_refused():
    ops = token_ops._family_ops()
    with pytest.raises(RuntimeError, match="side by side"):
        ops.gelu_tanh_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.soft_cap(torch.randn(2, 7).bfloat16(), 30.0)
    with pytest.raises(RuntimeError, match="at most 512"):
        ops.qk_norm_rope_write_kv(
            torch.randn(1, 3 * 640), torch.tensor([0]), torch.zeros(1, 2, 640), torch.zeros(2, 1, 1, 4, 640),
            torch.tensor([0]), 1, 1, torch.ones(640), torch.ones(640), 1e-6,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="norm weights"):
        ops.qk_norm_rope_write_kv(
            torch.randn(1, 24), torch.tensor([0]), torch.zeros(4, 2, 8), torch.zeros(2, 1, 2, 4, 8),
            torch.tensor([0]), 1, 1, torch.ones(7), torch.ones(8), 1e-6,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of range"):
        ops.qk_norm_rope_write_kv(
            torch.randn(1, 24), torch.tensor([4]), torch.zeros(4, 2, 8), torch.zeros(2, 1, 2, 4, 8),
            torch.tensor([0]), 1, 1, torch.ones(8), torch.ones(8), 1e-6,
        )  # fmt: skip


def test_the_modules_a_family_builds_choose_its_fused_ops():
    model = torch.nn.Sequential(HeadRMSNorm(8, 1e-6), GeluAndMul(), token_ops.RMSNorm(8, 1e-6), LogitSoftCap(30.0))
    fuse_token_ops(model)
    assert [type(m) for m in model] == [CpuHeadRMSNorm, CpuGeluAndMul, CpuRMSNorm, CpuLogitSoftCap]
    assert model[3].cap == 30.0


def test_a_machine_that_cannot_build_them_keeps_the_common_fused_ops(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension 'orcinus_cpu_family_ops'")

    monkeypatch.setattr(token_ops, "_family_ops", no_compiler)
    model = torch.nn.Sequential(HeadRMSNorm(8, 1e-6), GeluAndMul(), token_ops.RMSNorm(8, 1e-6), LogitSoftCap(3.0))
    with pytest.warns(UserWarning, match="fused CPU ops of some families are unusable here"):
        fuse_token_ops(model)
    assert [type(m) for m in model] == [CpuRMSNorm, GeluAndMul, CpuRMSNorm, LogitSoftCap]


@pytest.mark.parametrize("kind,extra", [("gemma2", GEMMA2), ("gemma3", GEMMA3)])
def test_a_fused_bfloat16_gemma_decodes_the_unfused_ones_tokens(kind, extra, tmp_path, monkeypatch):
    build(kind, tmp_path, **{**extra, "head_dim": 64})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fused = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=4)
    names = {type(m).__name__ for m in fused.engine.model.modules()}
    assert {"CpuGeluAndMul", "CpuRMSNorm", "CpuRotary"} <= names
    assert ("CpuHeadRMSNorm" in names) == (kind == "gemma3")
    assert ("CpuLogitSoftCap" in names) == (kind == "gemma2")  # only a model with a final soft cap builds one
    assert "CpuGeluAndMul" in fused.engine.executor.runner.describe()
    tokens = [o.token_ids for o in fused.generate(PROMPTS, params)]
    monkeypatch.setattr(token_ops, "FUSED_CPU", {})
    plain = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=4)
    assert not any(type(m).__name__.startswith("Cpu") for m in plain.engine.model.modules())
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == tokens


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 256])
def test_qk_norm_rope_writes_a_16_bit_cache_under_float32_as_its_float32_keys_rounded(cache_dtype, d):
    """--kv-cache-dtype (float16 by default on the CPU) under float32: the fused pass takes the 16-bit cache, its
    queries are those of a float32 cache bit for bit and its keys and values those rounded to nearest even (as .to()
    rounds), and both are PyTorch's chain to rounding."""
    qkv, positions, slots, rotary, (qn, kn), cache = rope_case(torch.float32, 7, 4, 1, d, True, 11)
    fused = rotary.on_table_of(CpuRotary)
    cq, ck = qn.on_weight_of(CpuHeadRMSNorm), kn.on_weight_of(CpuHeadRMSNorm)
    wide, narrow, ref = cache.clone(), cache.to(cache_dtype), cache.to(cache_dtype)
    assert fused._takes(qkv, positions, narrow, slots)
    q_wide = fused.norm_rope_write_kv(qkv, cq, ck, positions, wide, slots, 4, 1)
    q_narrow = fused.norm_rope_write_kv(qkv, cq, ck, positions, narrow, slots, 4, 1)
    assert torch.equal(q_narrow, q_wide) and torch.equal(narrow, wide.to(cache_dtype))
    want = rotary.norm_rope_write_kv(qkv, qn, kn, positions, ref, slots, 4, 1)
    assert torch.allclose(q_narrow, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(narrow.float(), ref.float(), rtol=2e-2 if cache_dtype == torch.bfloat16 else 2e-3, atol=0)
