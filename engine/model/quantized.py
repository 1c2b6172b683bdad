"""Low-bit copies of the weights for small batches on the CPU, where a decode step reads every weight once.

The decoder's projections: 4-bit, groups of 32 along the input, each with its own scale and minimum. That is
llama.cpp's Q4_1 format, so a Q4_1 checkpoint (the bundled model) loses nothing in the repacking: its
dequantized weights are requantized to the very same 4-bit codes; a quarter of bfloat16's bytes, and torch's
CPU int4 matmul computes in bfloat16. The LM head (the largest single matrix of a small model): 8-bit, a
scale per vocabulary row, for batches of up to INT8_HEAD_MAX_ROWS rows.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # weights per scale/minimum pair, as in Q4_1
# Up to this many rows torch's int8 matmul beats oneDNN's bfloat16 one on the LM head (2-core machine,
# SmolLM2's 49152 x 576 head: 1 row 0.46 vs 1.67 ms, 4 rows 0.88 vs 1.00, 8 rows 2.2 vs 1.3).
INT8_HEAD_MAX_ROWS = 4


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


class SmallBatchLinear(nn.Module):
    """A bias-free linear layer with a low-bit copy of its weight: batches of up to `max_rows` rows (small decode
    steps) read the copy; larger ones (big batches, prefill chunks: arithmetic rather than reading weights
    bounds them) the dense layer, which engine/model/packed_linear.py may swap."""

    def __init__(self, dense: nn.Linear, max_rows: int):
        super().__init__()
        self.dense = dense
        self.max_rows = max_rows

    @property
    def weight(self) -> nn.Parameter:
        return self.dense.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x) if x.shape[0] > self.max_rows else self.low_bit(x)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Linear(SmallBatchLinear):
    """The 4-bit copy: Q4_1's groups, packed for torch's CPU int4 matmul."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, max_rows: int):
        if weight.shape[1] % GROUP:
            raise ValueError(f"int4 weights need an input width divisible by {GROUP}, not {weight.shape[1]}")
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        super().__init__(dense, max_rows)
        codes, scale, low = quantize_groups(weight)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        # The kernel dequantizes (code - 8) * scale + zero, so zero is the group's value at code 8.
        zeros = (low + 8 * scale).t()
        self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zeros], dim=-1).to(dtype).contiguous(),
                             persistent=False)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


class Int8Linear(SmallBatchLinear):
    """The 8-bit copy (for the LM head): a scale per output row. It wraps the layer it was made from, whose weight
    stays shared, so a tied head stays tied to the embedding."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, max_rows: int):
        super().__init__(linear, max_rows)
        w = linear.weight.detach().float()
        # The codes are for the scale as stored (in `dtype`), which is what the matmul multiplies them by.
        scales = (w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127).to(dtype)
        codes = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


def use_low_bit(model: nn.Module, dtype: torch.dtype, max_rows: int) -> None:
    """Swap every decoder layer's projections for Int4Linear and the LM head for Int8Linear, in place.

    Call with the weights still in float32, before any cast, so the codes come from the exact values.
    """
    if model.is_last:
        model.lm_head = Int8Linear(model.lm_head, dtype, min(max_rows, INT8_HEAD_MAX_ROWS))
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if getattr(layer, name).bias is not None:
                continue  # Int4Linear has no bias: Qwen2's Q/K/V projection stays dense
            setattr(layer, name, Int4Linear(getattr(layer, name).weight.data, dtype, max_rows))
