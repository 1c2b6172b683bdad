"""4-bit weights for small batches on the CPU: groups of 32 along the input, each with its own scale and minimum.

That is llama.cpp's Q4_1 format, so a Q4_1 checkpoint (the bundled model) loses nothing in the repacking:
its dequantized weights are requantized to the very same 4-bit codes. A decode step reads every weight
once, and these are a quarter of bfloat16's bytes; torch's CPU int4 matmul computes in bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # weights per scale/minimum pair, as in Q4_1


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float weights -> 4-bit codes [N, K] (int32, 0..15), scales and minimums [N, K / 32].

    Q4_1's own rule: the group's minimum maps to 0 and its maximum to 15; weights dequantized from Q4_1
    sit on that grid already, so their codes come back exactly.
    """
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    low = groups.amin(-1, keepdim=True)
    scale = (groups.amax(-1, keepdim=True) - low) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant group: every code 0
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32)
    return codes.view(n, k), scale.squeeze(-1), low.squeeze(-1)


class Int4Linear(nn.Module):
    """A bias-free linear layer that keeps its dense weight and a packed 4-bit copy of it.

    Batches of up to `max_rows` rows (small decode steps) read the 4-bit copy; larger ones (big batches and
    prefill chunks, where arithmetic rather than reading weights bounds the matmul) the dense one.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, max_rows: int):
        super().__init__()
        if weight.shape[1] % GROUP:
            raise ValueError(f"int4 weights need an input width divisible by {GROUP}, not {weight.shape[1]}")
        codes, scale, low = quantize_groups(weight)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        # The kernel dequantizes (code - 8) * scale + zero, so zero is the group's value at code 8.
        zeros = (low + 8 * scale).t()
        self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zeros], dim=-1).to(dtype).contiguous(),
                             persistent=False)
        # What larger batches run: a plain linear layer, which engine/model/packed_linear.py may swap.
        self.dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.max_rows = max_rows

    @property
    def weight(self) -> nn.Parameter:
        return self.dense.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


def use_int4(model: nn.Module, dtype: torch.dtype, max_rows: int) -> None:
    """Swap every decoder layer's projections (not the embedding or the LM head) for Int4Linear, in place.

    Call with the weights still in float32, before any cast, so the codes come from the exact values.
    """
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if getattr(layer, name).bias is not None:
                continue  # Int4Linear has no bias: Qwen2's Q/K/V projection stays dense
            setattr(layer, name, Int4Linear(getattr(layer, name).weight.data, dtype, max_rows))
