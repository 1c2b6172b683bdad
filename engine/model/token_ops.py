"""The decoder's token-wise ops as modules, RMSNorm, SiLU- and GELU-and-multiply and RoPE (with the K/V cache write,
after a per-head norm for the families that norm queries and keys), a final logit soft cap, and their fused C++
versions for the CPU.

On the CPU each of PyTorch's small ops costs microseconds whatever its size (F.rms_norm alone runs as ~7 of them), so at
decode batch sizes the norms and the activation cost a tenth of a step; engine/kernels/csrc/cpu/token_ops.cpp does each
in one pass over the rows. They replace the modules in bfloat16 only (`fuse_token_ops`): there they give PyTorch's bits
but for rare last-place differences (float32 sums in another order, another exp); float32, the reference the tests
compare with transformers, keeps PyTorch's ops (the gain, largest at batch 1: docs/performance.md, Kernels). RoPE and
the cache write were a dozen small ops a layer (gather the table, multiply, swap halves, add, stack, scatter), a large
share of a small batch's decode step before they fused.
Under torch.compile they take PyTorch's formula, which Inductor fuses itself (their C++ call would break the graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import write_kv
from engine.kernels.availability import builds
from engine.kernels.cpu_ops import load_cpu_extension
from engine.model.direct_call import DirectCall


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

    def on_weight_of(self, cls: type[RMSNorm]) -> RMSNorm:
        """A `cls` (a subclass with other kernels) over this module's weight: the same Parameter, not a copy."""
        other = cls.__new__(cls)
        nn.Module.__init__(other)
        other.weight, other.eps = self.weight, self.eps
        return other


class SiluAndMul(nn.Module):
    """SwiGLU's activation: silu(gate) * up, from the fused gate/up projection's output [T, 2 * width]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU's activation (Gemma): gelu(gate), tanh-approximated, times up, from the fused gate/up output."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class LogitSoftCap(nn.Module):
    """Gemma 2's final logit soft cap, tanh(logits / cap) * cap: the logits bent smoothly into (-cap, cap)."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each query or key head (Gemma 3); its rotary fuses it with RoPE where it can (`norm_rope_write_kv`)."""


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (the GGUF loader undoes llama.cpp's Q/K row permutation)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_position: int,
        freq_factors: tuple[float, ...] | None = None,
        long: tuple[tuple[float, ...], int, float] | None = None,
    ):
        """`long`: LongRoPE's (divisors from a position on, that position, the cos/sin multiplier)."""
        super().__init__()
        cos, sin = _angles(head_dim, theta, range(max_position), freq_factors)
        if long is not None:
            factors, start, scale = long
            if start < max_position:
                cos[start:], sin[start:] = _angles(head_dim, theta, range(start, max_position), factors)
            cos, sin = cos * scale, sin * scale
        # [positions, 2, D]: cos for both halves, then -sin and sin, so a call is one gather and
        # x * cos + swap_halves(x) * sin. build_model casts it to the compute dtype once: the same values a
        # cast per call gave.
        table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)
        self.register_buffer("table", table, persistent=False)

    def on_table_of(self, cls: type[Rotary]) -> Rotary:
        """A `cls` (a subclass with other kernels) over this module's table: the same tensor, not a copy."""
        other = cls.__new__(cls)
        nn.Module.__init__(other)
        other.register_buffer("table", self.table, persistent=False)
        return other

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (queries and keys together) rotated by each row's position."""
        cos, sin = self.table[positions].to(x.dtype).unsqueeze(2).unbind(1)  # [T, 1, D] each
        return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin  # the halves swapped: no cat

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """A fused QKV [T, (Hq + 2 Hkv) * D] -> rotated queries [T, Hq, D]; rotated keys and the values go into
        the cache at slot_mapping. Views of the QKV throughout: q goes to attention strided."""
        d = self.table.shape[-1]
        qk, v = qkv.split([(num_heads + num_kv_heads) * d, num_kv_heads * d], dim=-1)
        # Queries and keys rotate in one call: half the small ops of a RoPE per tensor.
        q, k = self(qk.view(-1, num_heads + num_kv_heads, d), positions).split([num_heads, num_kv_heads], dim=1)
        write_kv(k, v.view(-1, num_kv_heads, d), kv_cache, slot_mapping)
        return q

    def norm_rope_write_kv(
        self,
        qkv: torch.Tensor,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """`rope_write_kv` with each query head normed by q_norm and each key head by k_norm before RoPE."""
        d = self.table.shape[-1]
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        qkv = torch.cat([q_norm(q.reshape(-1, d)).view(q.shape), k_norm(k.reshape(-1, d)).view(k.shape), v], dim=-1)
        return self.rope_write_kv(qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads)


def _angles(head_dim: int, theta: float, positions: range, freq_factors: tuple[float, ...] | None):
    """cos and sin [positions, head_dim / 2] of each position's angles, the frequencies divided by the factors."""
    inv_freq = base_frequencies(head_dim, theta)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    freqs = torch.outer(torch.arange(positions.start, positions.stop, dtype=torch.int64).float(), inv_freq)
    return freqs.cos(), freqs.sin()


def base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _ops():
    return load_cpu_extension("orcinus_cpu_token_ops")


def _family_ops():
    return load_cpu_extension("orcinus_cpu_family_ops")


class CpuRMSNorm(RMSNorm, DirectCall):
    """RMSNorm through the C++ op (the same weight Parameter as the module it replaced)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (
            torch.compiler.is_compiling()
            or x.dim() != 2
            or not x.is_contiguous()
            or (residual is not None and not residual.is_contiguous())
        ):
            return super().forward(x, residual)
        if residual is not None:
            return _ops().add_rms_norm(x, residual, self.weight, self.eps)
        return _ops().rms_norm(x, self.weight, self.eps)


class CpuSiluAndMul(SiluAndMul, DirectCall):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return super().forward(gate_up)
        return _ops().silu_mul(gate_up)


class CpuGeluAndMul(GeluAndMul, DirectCall):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return super().forward(gate_up)
        return _family_ops().gelu_tanh_mul(gate_up)


class CpuLogitSoftCap(LogitSoftCap, DirectCall):
    """The soft cap in one C++ pass over the float32 logits (PyTorch's is three, and a tensor each)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or logits.dtype != torch.float32 or not logits.is_contiguous():
            return super().forward(logits)
        return _family_ops().soft_cap(logits, self.cap)


class CpuHeadRMSNorm(CpuRMSNorm, HeadRMSNorm):
    """A per-head norm that CpuRotary.norm_rope_write_kv applies inside its C++ pass."""


SIXTEEN_BITS = (torch.float16, torch.bfloat16)  # a cache the C++ passes write under float32 (--kv-cache-dtype)


class CpuRotary(Rotary):
    """RoPE and the cache write in one C++ pass (the same table buffer as the module it replaced)."""

    def _takes(self, qkv, positions, kv_cache, slot_mapping) -> bool:
        """Whether the C++ pass takes these tensors (its layouts and one dtype throughout); else PyTorch's path."""
        return not (
            torch.compiler.is_compiling()
            or qkv.dim() != 2
            or qkv.stride(1) != 1
            or not kv_cache.is_contiguous()
            or not (kv_cache.dtype == qkv.dtype or (qkv.dtype == torch.float32 and kv_cache.dtype in SIXTEEN_BITS))
            or self.table.dtype != qkv.dtype
            or positions.dtype != torch.int64
            or slot_mapping.dtype != torch.int64
        )

    def rope_write_kv(self, qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads):
        if not self._takes(qkv, positions, kv_cache, slot_mapping):
            return super().rope_write_kv(qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads)
        return _ops().rope_write_kv(
            qkv, positions.contiguous(), self.table, kv_cache, slot_mapping.contiguous(), num_heads, num_kv_heads
        )

    def norm_rope_write_kv(self, qkv, q_norm, k_norm, positions, kv_cache, slot_mapping, num_heads, num_kv_heads):
        if (
            not self._takes(qkv, positions, kv_cache, slot_mapping)
            or not isinstance(q_norm, CpuHeadRMSNorm)
            or not isinstance(k_norm, CpuHeadRMSNorm)
            or q_norm.eps != k_norm.eps
            or q_norm.weight.dtype != qkv.dtype
            or k_norm.weight.dtype != qkv.dtype
            or self.table.shape[-1] > 512  # the op keeps a normed head on its stack
        ):
            return super().norm_rope_write_kv(
                qkv, q_norm, k_norm, positions, kv_cache, slot_mapping, num_heads, num_kv_heads
            )
        return _family_ops().qk_norm_rope_write_kv(
            qkv,
            positions.contiguous(),
            self.table,
            kv_cache,
            slot_mapping.contiguous(),
            num_heads,
            num_kv_heads,
            q_norm.weight,
            k_norm.weight,
            q_norm.eps,
        )


def can_fuse(device: torch.device, dtype: torch.dtype) -> bool:
    """Fused token ops here: bfloat16 on the CPU, where the op builds (a warning says why not, if it cannot)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and builds(_ops, "the fused CPU token ops are unusable here, using PyTorch's")
    )


def _family_ops_build() -> bool:
    """Whether family_ops.cpp builds here: where not, the families that use it keep the common fused ops."""
    return builds(_family_ops, "the fused CPU ops of some families are unusable here, using PyTorch's")


# Each token-op module a family may build -> its fused CPU version, made from the module it replaces (sharing its
# weight or table). A family picks its ops by the modules it builds; a new op is a line here.
FUSED_CPU: dict[type[nn.Module], Callable[[nn.Module], nn.Module]] = {
    RMSNorm: lambda m: m.on_weight_of(CpuRMSNorm),
    HeadRMSNorm: lambda m: m.on_weight_of(CpuHeadRMSNorm if _family_ops_build() else CpuRMSNorm),
    SiluAndMul: lambda m: CpuSiluAndMul(),
    GeluAndMul: lambda m: CpuGeluAndMul() if _family_ops_build() else m,
    LogitSoftCap: lambda m: CpuLogitSoftCap(m.cap) if _family_ops_build() else m,
    Rotary: lambda m: m.on_table_of(CpuRotary),
}


def fuse_token_ops(module: nn.Module, _done: dict[int, nn.Module] | None = None) -> None:
    """Swap every module of FUSED_CPU's types under `module` for its C++ version (after the final dtype cast);
    layers that shared one (a RoPE table) share its replacement."""
    done = {} if _done is None else _done
    for name, child in list(module.named_children()):
        fused = FUSED_CPU.get(type(child))
        if fused is None:
            fuse_token_ops(child, done)
            continue
        if id(child) not in done:
            done[id(child)] = fused(child)
        setattr(module, name, done[id(child)])
