"""oneDNN-packed projections (engine/model/packed_linear.py): bit-identical to F.linear at every row count, swapped
in for every dense linear layer of a bfloat16 CPU model, and only there."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM
from engine.model.packed_linear import PackedLinear, amx, can_pack, pack_linears

# oneDNN's bfloat16 kernels need AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU has neither).
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bfloat16 kernels on this CPU")
# Where the engine packs: not on a CPU with AMX, where oneDNN's packed GEMM is not F.linear's bits at every shape.
PACKS = can_pack(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not PACKS, reason="the engine does not pack on this CPU (no oneDNN bfloat16, or AMX)")
@pytest.mark.parametrize("rows", [1, 7, 32, 33, 512, 1000])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_is_bit_identical_to_f_linear(rows, threads):
    gen = torch.Generator().manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in [(96, 160), (576, 960), (1536, 576), (576, 3072)]:
            linear = nn.Linear(k, n, bias=False).bfloat16()
            x = torch.randn(rows, k, generator=gen).bfloat16()
            packed = PackedLinear.from_linear(linear)
            assert packed.weight is linear.weight and isinstance(packed, nn.Linear)
            assert torch.equal(packed(x), F.linear(x, linear.weight)), (k, n)
    finally:
        torch.set_num_threads(before)


@needs_onednn_bf16
def test_pack_linears_swaps_every_linear_and_keeps_ties():
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(50, 64),
            "proj": nn.Linear(64, 64, bias=False),
            "biased": nn.Linear(64, 64),
            "head": nn.Linear(64, 50, bias=False),
        }
    ).bfloat16()
    model["head"].weight = model["embed"].weight
    pack_linears(model)
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert type(model["biased"]) is nn.Linear  # a fused bias would round differently
    assert model["head"].weight is model["embed"].weight


def test_only_bfloat16_on_the_cpu_is_packed():
    # else its reorder raises (no oneDNN bfloat16) or its bits part from F.linear's (AMX): F.linear runs
    assert can_pack(torch.device("cpu"), torch.bfloat16) is (ONEDNN_BF16 and not amx())
    assert not can_pack(torch.device("cpu"), torch.float32)  # float32 stays the exact reference path
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


def test_a_bfloat16_engine_runs_packed_and_a_float32_one_does_not(checkpoint):
    bf16 = LLM(checkpoint=checkpoint, dtype="bfloat16", weights="dense").engine.model
    kind = PackedLinear if PACKS else nn.Linear
    assert type(bf16.layers[0].qkv_proj) is kind and type(bf16.lm_head) is kind
    fp32 = LLM(checkpoint=checkpoint, dtype="float32", weights="dense").engine.model
    assert type(fp32.layers[0].qkv_proj) is nn.Linear and type(fp32.lm_head) is nn.Linear
