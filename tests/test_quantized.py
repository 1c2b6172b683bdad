"""Low-bit weights (engine/model/quantized.py): Q4_1 codes come back exactly, the 4-bit matmul equals the dense one
within bfloat16's error, the 8-bit LM head is within its rounding of the dense one and shares its weight, and only a
Q4_1 model in bfloat16 on the CPU gets them by default."""

import pytest
import torch
import torch.nn.functional as F

from engine.core.config import EngineConfig
from engine.model.quantized import GROUP, Int4Linear, Int8Linear, quantize_groups
from engine.runner.device import DeviceError, int4_weights


def q4_1_weight(n: int, k: int, seed: int = 0):
    """Weights as llama.cpp's Q4_1 stores them: codes 0..15 (each group reaching 0 and 15), float16 scale and min."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g, dtype=torch.int32)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(n, k // GROUP, 1, generator=g) * 0.01 + 1e-4).half().float()
    low = (-torch.rand(n, k // GROUP, 1, generator=g) * 0.1).half().float()
    return (codes * scale + low).view(n, k), codes.view(n, k), scale.squeeze(-1), low.squeeze(-1)


def test_q4_1_codes_scales_and_minimums_come_back_exactly():
    w, codes, scale, low = q4_1_weight(48, 128)
    got_codes, got_scale, got_low = quantize_groups(w)
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_low, low)
    torch.testing.assert_close(got_scale, scale, rtol=1e-6, atol=0)


def test_a_constant_group_is_all_code_zero():
    codes, scale, low = quantize_groups(torch.full((2, GROUP), 0.25))
    assert codes.eq(0).all() and low.eq(0.25).all() and scale.eq(1).all()


def test_small_batches_read_the_4_bit_copy_and_large_ones_the_dense_weight():
    w, *_ = q4_1_weight(96, 256, seed=1)
    layer = Int4Linear(w, torch.bfloat16, max_rows=8)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = x.float() @ w.t()
    got = layer(x).float()
    assert got.dtype == torch.float32 and got.shape == (8, 96)
    # bfloat16 output and scales: a few parts in a thousand of the output's scale
    assert (got - want).abs().max() < 1e-2 * want.abs().max()
    big = torch.cat([x, x[:1]])  # 9 rows > max_rows
    assert torch.equal(layer(big), F.linear(big, w.to(torch.bfloat16)))


def test_the_8_bit_head_serves_small_batches_and_keeps_the_dense_weight_for_large_ones():
    g = torch.Generator().manual_seed(3)
    dense = torch.nn.Linear(64, 300, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(300, 64, generator=g) * torch.rand(300, 1, generator=g))  # rows of all sizes
    dense = dense.to(torch.bfloat16)
    head = Int8Linear(dense, torch.bfloat16, max_rows=4)
    assert head.weight is dense.weight and head.codes.dtype == torch.int8 and head.codes.abs().max() == 127
    # Each row's codes times its (stored) scale give the row back within half a scale; a row's largest weight,
    # whose code may be clamped to 127 when the stored scale rounded down, within one.
    scale = head.scales.float()[:, None]
    back = head.codes.float() * scale
    err = (back - dense.weight.float()).abs()
    clamped = head.codes.abs() == 127
    assert (err[~clamped] <= (0.5 * scale).expand_as(err)[~clamped] * (1 + 1e-6)).all()
    assert (err[clamped] <= scale.expand_as(err)[clamped]).all()
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    exact = x.float() @ back.t()
    assert torch.allclose(head(x).float(), exact, rtol=2e-2, atol=2e-2)  # bfloat16 accumulation and output
    big = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(head(big), dense(big))


def test_an_input_width_off_the_group_grid_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.zeros(4, 40), torch.bfloat16, 8)


@pytest.mark.parametrize("device, dtype, weights, quantization, want", [
    ("cpu", "bfloat16", "auto", "q4_1", True),
    ("cpu", "float32", "auto", "q4_1", False),  # float32 stays the exact reference
    ("cpu", "bfloat16", "auto", None, False),  # requantizing other weights would lose accuracy: only on request
    ("cuda", "bfloat16", "auto", "q4_1", False),
    ("cpu", "bfloat16", "int4", None, True),
    ("cpu", "bfloat16", "dense", "q4_1", False),
])
def test_which_configs_get_int4_weights(device, dtype, weights, quantization, want):
    assert int4_weights(EngineConfig(device=device, dtype=dtype, weights=weights), quantization) is want


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cuda", "bfloat16")])
def test_int4_where_the_kernel_is_missing_is_a_clear_error(device, dtype):
    with pytest.raises(DeviceError, match="int4 weights run on the CPU in bfloat16 only"):
        int4_weights(EngineConfig(device=device, dtype=dtype, weights="int4"), "q4_1")


def test_the_bundled_gguf_is_recognised_as_q4_1_and_a_dummy_is_not():
    from engine.model.loader import load_checkpoint

    assert load_checkpoint(None, weights=False).quantization == "q4_1"
    assert load_checkpoint("dummy:smollm2-135m").quantization is None
