"""The int16-activation op's packed weights (engine/kernels/csrc/cpu/int16_matmul.cpp): no wider than the file's
blocks, and its outputs exactly the sums a plain reference forms from the file's codes and scales, float step by float
step, at any row count."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine.model.quantized import INT16_TYPES, Int16BlockLinear, _int16_ops, can_use_int16
from tests.test_quantized import random_blocks

pytestmark = pytest.mark.skipif(
    not can_use_int16(torch.device("cpu")), reason="the int16 op needs AVX-512 VNNI or AVX2"
)

# Packed bytes a weight: the file's, but for Q4_K's 6-bit sub-block scales and minimums, stored as bytes.
PACKED_BYTES = {
    "Q4_0": 18 / 32,
    "Q4_1": 20 / 32,
    "Q5_0": 22 / 32,
    "Q8_0": 34 / 32,
    "Q4_K": 148 / 256,
    "Q5_K": 180 / 256,
    "Q6_K": 210 / 256,
}


def f16(b: np.ndarray) -> torch.Tensor:
    """Little-endian float16 bytes [..., 2] as float32."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def codes_and_scales(kind: GGMLQuantizationType, data: np.ndarray, cols: int):
    """The file's blocks [N, bytes] as integer codes less their offset [N, cols / 32, 32], each half's float32 scale
    [N, cols / 32, halves] (a K-quant's d times its sub-block scale) and each block's minimum [N, cols / 32] or None."""
    n = data.shape[0]
    if kind.name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        b = data.reshape(n, cols // 32, -1)
        scale, mins = f16(b[..., 0:2])[..., None], None
        if kind.name == "Q8_0":
            return torch.from_numpy(b[..., 2:].view(np.int8).astype(np.int64)), scale, None
        qs = b[..., 4:] if kind.name == "Q4_1" else b[..., 6:] if kind.name == "Q5_0" else b[..., 2:]
        c = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
        if kind.name == "Q4_1":
            mins = f16(b[..., 2:4])
        if kind.name == "Q5_0":
            qh = b[..., 2:6].copy().view(np.uint32).astype(np.int64)  # [n, blocks, 1]
            c |= ((qh >> np.arange(32)) & 1) << 4
        offset = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16}[kind.name]
        return torch.from_numpy(c - offset), scale, mins
    b = data.reshape(n, cols // 256, -1)
    c = np.zeros((n, cols // 256, 8, 32), np.int64)
    if kind.name in ("Q4_K", "Q5_K"):
        d, dmin, q = f16(b[..., 0:2]), f16(b[..., 2:4]), b[..., 4:16].astype(np.int64)
        sc, m = np.zeros((n, cols // 256, 8), np.int64), np.zeros((n, cols // 256, 8), np.int64)
        for j in range(8):  # ggml's get_scale_min_k4
            if j < 4:
                sc[..., j], m[..., j] = q[..., j] & 63, q[..., j + 4] & 63
            else:
                sc[..., j] = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
                m[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
            start = (16 if kind.name == "Q4_K" else 48) + 32 * (j // 2)
            qs = b[..., start : start + 32]
            c[..., j, :] = qs >> 4 if j % 2 else qs & 15
            if kind.name == "Q5_K":  # sub-block j's fifth bits: bit j of the 32 bytes after the scales
                c[..., j, :] |= ((b[..., 16:48] >> j) & 1).astype(np.int64) << 4
        scale = d[..., None] * torch.from_numpy(sc).float()
        mins = -(dmin[..., None] * torch.from_numpy(m).float())
        return torch.from_numpy(c).reshape(n, -1, 32), scale.reshape(n, -1, 1), mins.reshape(n, -1)
    d, sc = f16(b[..., 208:210]), b[..., 192:208].view(np.int8).astype(np.int64)  # Q6_K
    for j in range(8):
        half, quarter = j // 4, j % 4
        ql = b[..., 64 * half + 32 * (quarter % 2) : 64 * half + 32 * (quarter % 2) + 32].astype(np.int64)
        lo = ql & 15 if quarter < 2 else ql >> 4
        c[..., j, :] = (lo | (((b[..., 128 + 32 * half : 160 + 32 * half] >> (2 * quarter)) & 3) << 4)) - 32
    scale = d[..., None] * torch.from_numpy(sc).float()  # [n, super-blocks, 16]: two halves a block
    return torch.from_numpy(c).reshape(n, -1, 32), scale.reshape(n, -1, 2), None


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (float32 a * b is exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def reference(kind: GGMLQuantizationType, data: np.ndarray, cols: int, x: torch.Tensor) -> torch.Tensor:
    """The op's sums by hand: x rounded to int16 per 32 (round half to even), each half-block's integer sum, then per
    block in order acc = fma(sum, scale * d_x, acc) for each half and acc = fma(min, d_x * sum_x, acc)."""
    m = x.shape[0]
    xb = x.reshape(m, -1, 32)
    amax = xb.abs().amax(-1)
    # Tensor by tensor: torch divides by a scalar (and a scalar by a tensor) through a reciprocal, rounded twice.
    top = torch.full_like(amax, 32767)
    d = amax / top
    inv = torch.where(amax > 0, top / amax, 0.0)
    q = (xb * inv[..., None]).clamp(-32767, 32767).round().long()
    ds = d * q.sum(-1).float()
    c, scale, mins = codes_and_scales(kind, data, cols)
    halves = scale.shape[-1]
    sums = torch.einsum("mbhe,nbhe->mnbh", q.reshape(m, -1, halves, 32 // halves), c.reshape(*c.shape[:2], halves, -1))
    acc = torch.zeros(m, c.shape[0])
    for b in range(c.shape[1]):
        for h in range(halves):
            acc = fma(sums[..., b, h].float(), scale[None, :, b, h] * d[:, b, None], acc)
        if mins is not None:
            acc = fma(mins[None, :, b], ds[:, b, None], acc)
    return acc


# Whole tiles of 16 outputs, three of them; K a number of blocks that is no power of two, not a multiple of 256 where the
# format allows (the K-quants come in 256-weight super-blocks).
CASES = [
    (GGMLQuantizationType(t), 768 if GGMLQuantizationType(t).name.endswith("_K") else 544) for t in sorted(INT16_TYPES)
]


@pytest.mark.parametrize("kind, cols", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_the_int16_op_is_the_reference_sums_bit_for_bit(kind, cols):
    blocks = random_blocks(kind, 48, cols, seed=21)
    layer = Int16BlockLinear([blocks])
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(22)) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0
    want = reference(kind, blocks.data.numpy(), cols, x)
    for rows in (1, 33):  # a lone decoding row; a batch of tiles of rows and a ragged one
        assert torch.equal(layer(x[:rows]), want[:rows])


@pytest.mark.parametrize("kind", sorted(PACKED_BYTES), ids=str)
def test_packed_weights_are_no_wider_than_the_files(kind):
    """Nibbles, the 5- and 6-bit formats' high bits packed, the file's float16 scales: a step reads the file."""
    t = GGMLQuantizationType[kind]
    blocks = random_blocks(t, 32, 1024)
    packed = _int16_ops().pack(blocks.data, int(t), 1024)
    assert packed.numel() / (32 * 1024) == PACKED_BYTES[kind]
    assert packed.numel() <= blocks.data.numel() * 1.03


def test_the_build_names_the_instructions_it_runs_on():
    """The startup block's reason for int16 activations comes from the op's build, not from the CPU's flags: a
    -march=haswell build on an AVX-512 machine says AVX2."""
    from engine.kernels import cpu_ops
    from engine.model.quantized import int16_build_isa

    with open("/proc/cpuinfo") as f:
        vnni = "avx512_vnni" in f.read()
    assert int16_build_isa() == ("AVX-512 VNNI" if vnni and cpu_ops._MARCH == "native" else "AVX2")
