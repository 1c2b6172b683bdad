"""Dense bfloat16 projections with their weights in oneDNN's blocked layout, on the CPU.

F.linear gives oneDNN a plain [N, K] weight, which it reorders for its GEMM kernel on every call; a copy
reordered once at load runs the same arithmetic (bit-identical outputs) without that reorder, which dominates a
large projection such as the LM head at decode batch sizes (docs/performance.md, Kernels).
"""

from __future__ import annotations

import torch
from torch import nn

ROWS_HINT = 32  # oneDNN picks the blocking for this many rows; any row count runs


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear here: bfloat16 on a CPU where oneDNN has bfloat16 kernels (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; elsewhere its reorder raises, and F.linear runs) (float32 keeps F.linear, the exact reference).
    Not on a CPU with AMX tiles: there oneDNN's packed GEMM summed one shape in another order than F.linear's
    (512 rows, 2 threads, 1536 -> 576), and packing must not change a bit."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and not amx()
    )


def amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own check; False where torch has none)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


class PackedLinear(nn.Linear):
    """A bias-free nn.Linear (the same weight: tied weights stay tied) that multiplies with its packed copy."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        assert linear.bias is None, "oneDNN's fused bias rounds differently from addmm: biased layers stay F.linear"
        packed.weight, packed.bias = linear.weight, None
        reordered = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        packed.register_buffer("packed_weight", reordered, persistent=False)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")


def pack_linears(module: nn.Module) -> None:
    """Swap every bias-free nn.Linear under `module` (the int4 layers' dense fallbacks included) for a PackedLinear.

    Layers with a bias (Qwen2's Q/K/V) keep F.linear: oneDNN's fused bias add rounds differently from addmm's at
    some sizes, and packing must not change a single bit. Call after the weights are cast to their final dtype:
    the packed copy does not follow later casts.
    """
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None and not isinstance(child, PackedLinear):
            setattr(module, name, PackedLinear.from_linear(child))
        else:
            pack_linears(child)
