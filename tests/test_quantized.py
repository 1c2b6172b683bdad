"""The GGUF block weights (engine/model/quantized.py, engine/kernels/csrc/cpu/block_matmul.cpp): every block type
decodes to gguf's own dequantization bit for bit, the matmul is the float32 product of those weights, a row's bits do
not depend on the batch or the threads, the bundled model's blocks are its float32 weights, and the CPU default runs on
them."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.core.config import EngineConfig
from engine.model.output_buffer import OutputBuffer
from engine.model.quantized import (
    INT16_TYPES,
    QUANTIZED_TYPES,
    BlockLinear,
    Blocks,
    Int16BlockLinear,
    _int16_ops,
    can_use_int16,
    dequantize,
    use_block_weights,
)
from engine.runner.device import DeviceError, block_weights, int16_activations

TYPES = [GGMLQuantizationType(t) for t in QUANTIZED_TYPES]
# Where each type keeps its float16 scale (and minimum) in a block: random bytes there could be infinities or NaNs.
SCALE_OFFSETS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> Blocks:
    """Random codes (every bit pattern a block may hold) with finite float16 scales of either sign, zeros included."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind.name]:
        scales = (rng.standard_normal((rows, cols // size)) * 0.02).astype(np.float16)
        scales[:, 0], scales[:, -1] = 0.0, -0.0  # zero scales (or minimums) of both signs
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // size, 2)
    return Blocks(int(kind), torch.from_numpy(data.reshape(rows, -1)), cols)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_every_block_type_decodes_to_ggufs_own_dequantization_bit_for_bit(kind):
    blocks = random_blocks(kind, 37, 512)
    want = gguf_dequantize(blocks.data.numpy(), kind).reshape(37, 512)
    assert torch.equal(dequantize(blocks).view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_the_matmul_is_the_float32_product_of_those_weights(kind):
    blocks = random_blocks(kind, 70, 512, seed=1)
    w = dequantize(blocks).double()
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(2))
    layer = BlockLinear([blocks])
    for rows in (1, 3, 4, 5, 8, 9, 13):  # the register path (up to 8 rows) and the decoded panels
        want = x[:rows].double() @ w.t()
        # float32 sums of 512 products: each within 512 ulps of the sum of magnitudes, far looser than what occurs
        bound = 512 * 2**-24 * (x[:rows].double().abs() @ w.abs().t())
        assert ((layer(x[:rows]).double() - want).abs() <= bound).all()
    # bfloat16 activations: the same float32 sums of the bfloat16 inputs, rounded once to bfloat16 at the end
    xb = x.bfloat16()
    got, want = layer(xb), (xb.double() @ w.t())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 512 * 2**-24 * (xb.double().abs() @ w.abs().t())).all()


@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K], ids=lambda t: t.name
)
def test_a_rows_bits_are_the_same_alone_in_any_batch_and_on_any_number_of_threads(kind):
    layer = BlockLinear([random_blocks(kind, 203, 768, seed=3)])  # 203 outputs: ragged tiles and panels
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = layer(x)
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)
    for rows in range(1, 17):
        assert torch.equal(layer(x[:rows]), full[:rows])
        assert torch.equal(layer(x[rows : rows + 1]), full[rows : rows + 1])


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_inputs_wide_enough_that_a_panel_is_one_tile(kind):
    """Past 8192 inputs a decoded panel (sized for L2) is a single register tile wide: it still gets its buffer (a
    7B-14B model's down projection; K-quants always decode a panel, the 32-weight formats past a few rows)."""
    blocks = random_blocks(kind, 12, 8448, seed=9)
    x = torch.randn(11, 8448, generator=torch.Generator().manual_seed(10))
    want = x.double() @ dequantize(blocks).double().t()
    assert (
        (BlockLinear([blocks])(x).double() - want).abs()
        <= 8448 * 2**-24 * (x.double().abs() @ dequantize(blocks).double().abs().t())
    ).all()


def test_parts_of_different_types_make_one_output_and_a_bias_is_added():
    q, k = random_blocks(GGMLQuantizationType.Q4_K, 64, 512, seed=5), random_blocks(GGMLQuantizationType.Q6_K, 32, 512)
    bias = torch.randn(96)
    x = torch.randn(5, 512)
    got = BlockLinear([q, k], bias)(x)
    assert torch.equal(got, torch.cat([BlockLinear([q])(x), BlockLinear([k])(x)], dim=1) + bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_weights_as_blocks_share_their_memory_and_give_the_float32_product(dtype):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    blocks = Blocks.of_dense(w)
    assert blocks.data.data_ptr() == w.data_ptr()
    assert torch.equal(dequantize(blocks), w.float())
    x = torch.randn(6, 96, dtype=dtype if dtype != torch.float16 else torch.float32)
    torch.testing.assert_close(
        BlockLinear([blocks])(x).float(),
        F.linear(x.float(), w.float()),
        rtol=1e-5 if x.dtype == torch.float32 else 1e-2,
        atol=1e-5,
    )


def test_an_input_width_off_the_block_grid_is_refused():
    blocks = random_blocks(GGMLQuantizationType.Q4_K, 4, 256)
    with pytest.raises(RuntimeError, match="whole number of 256-weight blocks"):
        dequantize(Blocks(blocks.type, blocks.data, 200))


def test_the_bundled_models_blocks_are_its_float32_weights(checkpoint):
    """Q4_1 projections and the Q8_0 embedding (the tied LM head), Q and K rows un-permuted like the float weights."""
    kinds = {b.type for b in checkpoint.blocks.values()}
    assert kinds == {int(GGMLQuantizationType.Q4_1), int(GGMLQuantizationType.Q8_0)}
    assert len(checkpoint.blocks) == 30 * 7 + 1
    for name, blocks in checkpoint.blocks.items():
        assert torch.equal(dequantize(blocks).view(torch.int32), checkpoint.weights[name].view(torch.int32)), name


def test_the_served_default_never_dequantizes_a_tensor_it_keeps_as_blocks(checkpoint):
    """A checkpoint's float32 tensors are read one at a time, when a parameter needs them: the layers that keep the
    file's blocks never have theirs made (a 4-bit 8B model would otherwise pass through 32 GB of float32)."""
    from engine.model.loader import Checkpoint, LazyWeights
    from engine.runner.local_executor import build_model

    read = []
    lazy = LazyWeights(
        {name: (lambda name=name: read.append(name) or checkpoint.weights[name]) for name in checkpoint.weights}
    )
    counted = Checkpoint(checkpoint.name, checkpoint.shape, lazy, None, checkpoint.blocks)
    model = build_model(counted, 256, EngineConfig(device="cpu", dtype="float32"))
    assert sorted(read) == sorted(set(checkpoint.weights) - set(checkpoint.blocks) | {"model.embed_tokens.weight"})
    assert isinstance(model.lm_head, BlockLinear) and model.embed_tokens.weight.dtype == torch.float32
    assert sum(isinstance(m, BlockLinear) for m in model.modules()) == 30 * 4 + 1  # qkv, o, gate_up, down; the head


@pytest.mark.parametrize(
    "device, dtype, weights, has_blocks, want",
    [
        ("cpu", "float32", "auto", True, True),
        ("cpu", "bfloat16", "auto", True, True),  # the same weights, bfloat16 activations
        ("cpu", "float16", "auto", True, False),  # the op takes float32 or bfloat16 activations
        ("cpu", "float32", "auto", False, False),  # a Hugging Face checkpoint or a dummy: dense weights
        ("cpu", "float32", "dense", True, False),
        ("cpu", "float32", "gguf", True, True),
        ("cuda", "bfloat16", "auto", True, False),
    ],
)
def test_which_configs_get_the_block_weights(device, dtype, weights, has_blocks, want):
    assert block_weights(EngineConfig(device=device, dtype=dtype, weights=weights), has_blocks) is want


@pytest.mark.parametrize(
    "device, dtype, has_blocks, error",
    [
        ("cuda", "bfloat16", True, "on the CPU in float32 or bfloat16 only"),
        ("cpu", "float16", True, "on the CPU in float32 or bfloat16 only"),
        ("cpu", "float32", False, "needs a GGUF file with quantized tensors"),
    ],
)
def test_gguf_weights_where_they_cannot_be_are_a_clear_error(device, dtype, has_blocks, error):
    with pytest.raises(DeviceError, match=error):
        block_weights(EngineConfig(device=device, dtype=dtype, weights="gguf"), has_blocks)


def test_the_cpu_default_is_float32_on_the_files_blocks(checkpoint):
    from engine import LLM
    from engine.model.token_ops import CpuRMSNorm

    llm = LLM(checkpoint=checkpoint)
    model = llm.engine.model
    assert llm.engine.config.dtype == "float32"
    layer = model.layers[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert getattr(layer, name).types == [int(GGMLQuantizationType.Q4_1)] * len(getattr(layer, name).types)
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.types == [int(GGMLQuantizationType.Q8_0)]
    if can_use_int16(torch.device("cpu")):  # a lone decoding row in integers, where the CPU has the int16 op
        assert isinstance(layer.qkv_proj, Int16BlockLinear) and isinstance(model.lm_head, Int16BlockLinear)
    assert isinstance(layer.input_layernorm, CpuRMSNorm)  # the fused token ops, in float32 here
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())  # no dense copy kept beside the blocks


needs_int16 = pytest.mark.skipif(
    not can_use_int16(torch.device("cpu")), reason="the int16 op needs AVX-512 VNNI or AVX2"
)


def int16_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int16 op reads it: each 32 inputs rounded to multiples of max|x| / 32767 (float64)."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax.float() / 32767).double()  # the op's scale is a float32
    q = torch.where(amax > 0, (blocks.float() * (32767 / amax.float())).round().double(), 0.0)
    return (q * d).reshape(x.shape)


# One block, 17 blocks, 48 blocks; the K-quants in whole 256-weight super-blocks: one, and 6.
INT16_CASES = [
    (GGMLQuantizationType(t), cols)
    for t in sorted(INT16_TYPES)
    for cols in ([256, 1536] if GGML_QUANT_SIZES[GGMLQuantizationType(t)][0] == 256 else [32, 544, 1536])
]


@needs_int16
@pytest.mark.parametrize("kind, cols", INT16_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_the_int16_path_is_the_product_of_the_rounded_inputs_and_the_files_weights(kind, cols):
    blocks = random_blocks(kind, 48, cols, seed=5)  # three tiles of 16 outputs
    w = dequantize(blocks).double()
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(6)) * 3  # a tile of 8 rows of x, then 1
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    layer = Int16BlockLinear([blocks])
    got = torch.empty(9, 48)
    _int16_ops().int16_matmul(x, layer._parts, layer.types, got)  # the op itself takes any number of rows
    want = int16_rounded(x) @ w.t()
    # integer block sums are exact: what is left is float32 scaling and a sum over the blocks
    bound = 4 * (cols // 32) * 2**-24 * (int16_rounded(x).abs() @ w.abs().t()) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    # and within int16 rounding of the float32 product
    exact = x.double() @ w.t()
    assert ((got.double() - exact).abs() <= (x.double().abs() @ w.abs().t()) * 2**-15).all()
    # a row's result is the same alone and beside others
    assert torch.equal(Int16BlockLinear([blocks])(x[1:2]), got[1:2])
    # bfloat16 activations give bfloat16 outputs of the same sums
    assert Int16BlockLinear([blocks])(x[:1].bfloat16()).dtype == torch.bfloat16


@needs_int16
@pytest.mark.parametrize(
    "kind, cols",
    [
        (GGMLQuantizationType.Q5_0, 640),
        (GGMLQuantizationType.Q5_0, 896),
        (GGMLQuantizationType.Q5_0, 2048),
        (GGMLQuantizationType.Q4_K, 768),
        (GGMLQuantizationType.Q4_K, 2048),
        (GGMLQuantizationType.Q6_K, 768),
        (GGMLQuantizationType.Q6_K, 2048),
    ],
    ids=lambda c: getattr(c, "name", str(c)),
)
def test_q5_0_and_the_k_quants_take_the_int16_path_at_any_row_count(kind, cols):
    """A Q4_K_M file's formats: the product of the file's weights within int16 rounding, a row's bits its own."""
    blocks = random_blocks(kind, 32, cols, seed=11)
    w = dequantize(blocks).double()
    layer = Int16BlockLinear([blocks])
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(12)) * 3
    batch = layer(x)
    for rows in (1, 3, 16, 33):
        got = layer(x[:rows])
        assert torch.equal(got, batch[:rows])  # the same bits at every row count
        want = int16_rounded(x[:rows]) @ w.t()
        bound = 4 * (cols // 32) * 2**-24 * (int16_rounded(x[:rows]).abs() @ w.abs().t()) + 1e-30
        assert ((got.double() - want).abs() <= bound).all()
        exact = x[:rows].double() @ w.t()
        assert ((got.double() - exact).abs() <= (x[:rows].double().abs() @ w.abs().t()) * 2**-15).all()
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer(x), batch)  # nor on how the outputs' tiles are split among threads
    finally:
        torch.set_num_threads(2)
    blocks_linear = nn_layers_of(kind, blocks)
    assert type(blocks_linear) is Int16BlockLinear


def nn_layers_of(kind: GGMLQuantizationType, blocks: Blocks) -> torch.nn.Module:
    """use_block_weights' choice for one linear layer over `blocks`, with int16 activations."""
    from engine.model.decoder import Source

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(blocks.cols, blocks.rows, bias=False)

        def sources(self):
            return {"proj.weight": Source(("p",))}

    model = One()
    use_block_weights(model, {"p": blocks}, int16=True)
    return model.proj


@needs_int16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_is_rounded_to_the_nearest_even_code_of_its_blocks_scale(dtype):
    """Against one-hot Q8_0 weights (code 1, scale 1) output i is x's code i times the block's scale, exactly: the
    rounding itself is visible, ties and clamping included."""
    data = np.zeros((64, 2, 34), np.uint8)  # 64 outputs, 64 inputs: output i reads input i alone
    data[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
    for i in range(64):
        data[i, i // 32, 2 + i % 32] = 1
    packed = _int16_ops().pack(torch.from_numpy(data.reshape(64, -1)), int(GGMLQuantizationType.Q8_0), 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-4, 4, 64)
    x[1, :32] = torch.tensor([32767.0, 2.5, -2.5, 3.5, -3.5, 0.5, 1.5, -0.5] * 4)  # scale 1: codes at exact ties
    x[2, :32] = 0.0  # scale 0
    x[3, 32:] = torch.tensor([1e-30, -7.0] * 16)  # tiny against the block's largest: code 0
    x = x.to(dtype)
    got = torch.empty(5, 64, dtype=dtype)
    _int16_ops().int16_matmul(x, [packed], [int(GGMLQuantizationType.Q8_0)], got)
    blocks = x.float().reshape(5, 2, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 32767
    codes = torch.where(amax > 0, (blocks * (32767 / amax)).clamp(-32767, 32767).round(), 0.0)  # half to even
    assert torch.equal(got, (codes * scale).reshape(5, 64).to(dtype))
    if dtype == torch.float32:  # bfloat16 holds 32767 as 32768: its scale is not 1
        assert got[1, :8].tolist() == [32767.0, 2.0, -2.0, 4.0, -4.0, 0.0, 2.0, -0.0]


@needs_int16
def test_a_rows_int16_result_does_not_depend_on_its_batch():
    parts = [
        random_blocks(GGMLQuantizationType.Q4_1, 48, 576, seed=7),
        random_blocks(GGMLQuantizationType.Q8_0, 16, 576),
    ]
    layer = Int16BlockLinear(parts)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(8))  # tiles of 8 rows and a ragged one
    batch = layer(x)
    assert batch.shape == (37, 64)
    for r in (0, 9, 36):
        assert torch.equal(layer(x[r : r + 1]), batch[r : r + 1])
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer(x), batch)  # nor on how the outputs' tiles are split among threads
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("activations, invariant", [("auto", False), ("auto", True), ("float32", True)])
def test_which_configs_round_activations_to_int16(activations, invariant):
    config = EngineConfig(device="cpu", block_activations=activations, batch_invariant=invariant)
    assert int16_activations(config) is (activations == "auto" and can_use_int16(torch.device("cpu")))


@needs_int16
def test_only_whole_tiles_of_rows_take_the_int16_path():
    from engine.model.decoder import Source

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ragged, self.whole = torch.nn.Linear(64, 23, bias=False), torch.nn.Linear(64, 32, bias=False)

        def sources(self):
            return {"ragged.weight": Source(("r",)), "whole.weight": Source(("w",))}

    model = Two()
    kind = GGMLQuantizationType.Q8_0
    use_block_weights(model, {"r": random_blocks(kind, 23, 64), "w": random_blocks(kind, 32, 64)}, int16=True)
    assert type(model.ragged) is BlockLinear and type(model.whole) is Int16BlockLinear
    with pytest.raises(RuntimeError, match="whole tiles of 16 rows"):
        _int16_ops().pack(random_blocks(kind, 23, 64).data, int(kind), 64)


def test_the_lm_head_writes_each_step_s_logits_into_the_same_memory(checkpoint):
    """The LM head's logits outgrow what malloc recycles at a large vocabulary and batch (a fresh 33 MB tensor faults
    in every page each step): under inference mode the head writes into the memory it kept, the same bits as a fresh
    tensor, a larger batch growing it; outside inference mode (autograd may keep the output) a fresh tensor."""
    from engine.runner.local_executor import build_model

    model = build_model(checkpoint, 256, EngineConfig(device="cpu", dtype="float32"))
    head = model.lm_head
    assert isinstance(head.output, OutputBuffer)
    x = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(3))
    head.output = None
    with torch.inference_mode():
        want = head(x)  # a fresh tensor
    head.output = OutputBuffer()
    with torch.inference_mode():
        first = head(x[:3])
        second = head(x)  # larger: new memory, kept from here on
        third = head(x[:2])
        assert third.data_ptr() == second.data_ptr()
        assert torch.equal(third, want[:2])
    assert torch.equal(first, want[:3]) and torch.equal(second[2:], want[2:])
    assert head(x).data_ptr() != second.data_ptr()  # no inference mode: a tensor of its own
