"""The decoder's token-wise ops as modules, RMSNorm and SiLU-and-multiply, and their fused C++ versions for the CPU.

On the CPU each of PyTorch's small ops costs microseconds whatever its size (F.rms_norm alone runs as ~7 of
them), so at decode batch sizes the norms and the activation cost a tenth of a step; cuda/token_ops_cpu.cpp
does each in one pass over the rows. They replace the modules in bfloat16 only (`fuse_token_ops`): there
they give PyTorch's bits but for rare last-place differences (float32 sums in another order, another exp);
float32, the reference the tests compare with transformers, keeps PyTorch's ops. Measured on the 2-core
machine (benchmarks/offline_cpu_token_ops.json): decode 1.15x / 1.08x / 1.05x at batch 1 / 8 / 32.
Under torch.compile they take PyTorch's formula, which Inductor fuses itself (their C++ call would break the graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.cpp_extension import builds, load_cpu_extension


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the residual add before it too: (residual + x, norm(residual + x))."""
        if residual is not None:
            x = residual + x
            return x, self.forward(x)
        # torch's fused kernel: bit-identical to transformers' formula in float32; in bfloat16 it keeps the
        # statistics in float32 and rounds once (the formula rounds twice), so it is closer to float32 too.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SiluAndMul(nn.Module):
    """SwiGLU's activation: silu(gate) * up, from the fused gate/up projection's output [T, 2 * width]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _ops():
    return load_cpu_extension("orcinus_cpu_token_ops", "token_ops_cpu.cpp")


class CpuRMSNorm(RMSNorm):
    """RMSNorm through the C++ op (the same weight Parameter as the module it replaced)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (torch.compiler.is_compiling() or x.dim() != 2 or not x.is_contiguous()
                or (residual is not None and not residual.is_contiguous())):
            return super().forward(x, residual)
        if residual is not None:
            return _ops().add_rms_norm(x, residual, self.weight, self.eps)
        return _ops().rms_norm(x, self.weight, self.eps)


class CpuSiluAndMul(SiluAndMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return super().forward(gate_up)
        return _ops().silu_mul(gate_up)


def can_fuse(device: torch.device, dtype: torch.dtype) -> bool:
    """Fused token ops here: bfloat16 on the CPU, where the op builds (a warning says why not, if it cannot)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and builds(
        _ops, "the fused CPU token ops are unusable here, using PyTorch's")


def fuse_token_ops(module: nn.Module) -> None:
    """Swap every RMSNorm and SiluAndMul under `module` for its C++ version (after the final dtype cast)."""
    for name, child in list(module.named_children()):
        if type(child) is RMSNorm:
            fused = CpuRMSNorm.__new__(CpuRMSNorm)
            nn.Module.__init__(fused)
            fused.weight, fused.eps = child.weight, child.eps
            setattr(module, name, fused)
        elif type(child) is SiluAndMul:
            setattr(module, name, CpuSiluAndMul())
        else:
            fuse_token_ops(child)
