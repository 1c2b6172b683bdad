"""The decoder's token-wise ops as CUDA kernels on a GPU: RoPE with the K/V cache write
(engine/kernels/csrc/cuda/rope_write_kv.cu) and RMSNorm with its residual add (rms_norm.cu beside it), in place of the
PyTorch formulas.

Traced by torch.compile, RoPE and the cache write were ~10 small kernels a layer, whose launches outweigh their
few KB of data at decode batch sizes (docs/performance.md, GPU); this is one launch. It gives the
formula's eager bits (products rounded to the dtype, then their sum). Under torch.compile it is a custom op that
mutates the cache, so Inductor calls it in place (as it does `write_kv`). Each RMSNorm was two kernels (a looped
reduction and a pointwise pass re-reading the row); the kernel is one, the residual's sum written
beside the output; its mean sums in another order than PyTorch's, so an output may differ in its last place.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from engine.kernels.availability import builds
from engine.kernels.nvrtc import CUDA_SOURCES, DTYPE_SUFFIX, NvrtcKernels, ptr
from engine.model.token_ops import HeadRMSNorm, RMSNorm, Rotary

KERNEL_SOURCE = CUDA_SOURCES / "rope_write_kv.cu"
THREADS = 128  # kThreads in the kernel: each thread rotates (or copies) one pair of a head's elements
NORM_SOURCE = CUDA_SOURCES / "rms_norm.cu"
NORM_THREADS = 256  # kThreads in rms_norm.cu: a block a row


def kernel_names() -> list[str]:
    """Every function of rope_write_kv.cu this module may launch."""
    return [f"rope_write_kv_{s}" for s in DTYPE_SUFFIX.values()]


def norm_kernel_names() -> list[str]:
    """Every function of rms_norm.cu this module may launch."""
    return [f"rms_norm_{s}" for s in DTYPE_SUFFIX.values()]


class RopeWriteKV:
    """The kernel's launcher: one per process (the compiled module and its per-device functions)."""

    def __init__(self) -> None:
        self.kernels = NvrtcKernels(KERNEL_SOURCE, "rope_write_kv_bf16", "the CUDA RoPE kernel")

    def __call__(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        table: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        rows, d = qkv.shape[0], table.shape[-1]
        q = qkv.new_empty((rows, num_heads, d))
        if rows == 0:
            return q
        pairs = (num_heads + 2 * num_kv_heads) * (d // 2)
        with self.kernels.on_torch_stream(qkv):
            self.kernels(f"rope_write_kv_{DTYPE_SUFFIX[qkv.dtype]}", qkv.device)(
                (rows, -(-pairs // THREADS)),
                (THREADS,),
                (
                    ptr(q),
                    ptr(kv_cache),
                    ptr(qkv),
                    ptr(table),
                    ptr(positions),
                    ptr(slot_mapping),
                    np.int64(qkv.stride(0)),
                    np.int64(kv_cache.shape[2] * kv_cache.shape[3]),
                    np.int32(num_heads),
                    np.int32(num_kv_heads),
                    np.int32(d),
                ),
            )
        return q

    def self_test(self) -> None:
        """Rotate 3 rows (GQA, bf16, strided QKV rows) and compare bit for bit with the PyTorch formula."""
        gen = torch.Generator().manual_seed(0)
        rotary = Rotary(64, 10000.0, 32).to(torch.bfloat16)
        wide = torch.randn(3, 6 * 64 + 8, generator=gen).to(torch.bfloat16)
        qkv = wide[:, : 6 * 64]  # 4 + 2 x 1 heads, rows strided as a wider projection's output would be
        positions, slots = torch.tensor([0, 7, 31]), torch.tensor([5, 16, 2])
        dev = torch.device("cuda", torch.cuda.current_device())
        cache = torch.zeros(2, 1, 2, 16, 64, dtype=torch.bfloat16)
        got_cache = cache.to(dev)
        got_q = self(wide.to(dev)[:, : 6 * 64], positions.to(dev), rotary.table.to(dev), got_cache, slots.to(dev), 4, 1)
        q = rotary.rope_write_kv(qkv, positions, cache, slots, 4, 1)
        if not (torch.equal(got_q.cpu(), q) and torch.equal(got_cache.cpu(), cache)):
            raise RuntimeError("the RoPE kernel's self-test output differs from the PyTorch formula")


@functools.cache
def launcher() -> RopeWriteKV:
    """The process's launcher: NVRTC compiles the source once."""
    return RopeWriteKV()


@torch.library.custom_op("orcinus::rope_write_kv", mutates_args=("kv_cache",))
def _rope_write_kv_op(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    return launcher()(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads)


@_rope_write_kv_op.register_fake
def _(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], num_heads, table.shape[-1]))


def cuda_rope_available() -> bool:
    """Whether the kernel compiles and matches the formula here (a warning says why not, if it does not)."""
    return torch.cuda.is_available() and builds(
        lambda: launcher().self_test(), "the CUDA RoPE kernel is unusable here, using PyTorch's ops"
    )


class CudaRotary(Rotary):
    """RoPE and the cache write in one kernel (the same table buffer as the module it replaced)."""

    def rope_write_kv(self, qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads):
        if (
            not qkv.is_cuda
            or qkv.dim() != 2
            or qkv.stride(1) != 1
            or qkv.dtype not in DTYPE_SUFFIX
            or kv_cache.dtype != qkv.dtype
            or self.table.dtype != qkv.dtype
            or not kv_cache.is_contiguous()
            or not self.table.is_contiguous()
            or positions.dtype != torch.int64
            or slot_mapping.dtype != torch.int64
        ):
            return super().rope_write_kv(qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads)
        args = (qkv, positions.contiguous(), self.table, kv_cache, slot_mapping.contiguous(), num_heads, num_kv_heads)
        if torch.compiler.is_compiling():
            return torch.ops.orcinus.rope_write_kv(*args)  # an op boundary Inductor keeps, writing the cache in place
        return launcher()(*args)


def use_cuda_rotary(module: nn.Module) -> None:
    """Swap every Rotary under `module` for CudaRotary; layers that shared a table share its replacement."""
    swapped: dict[int, Rotary] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Rotary:
                if id(child) not in swapped:
                    swapped[id(child)] = child.on_table_of(CudaRotary)
                setattr(parent, name, swapped[id(child)])


class RmsNormKernel:
    """The RMSNorm kernel's launcher: one per process."""

    def __init__(self) -> None:
        self.kernels = NvrtcKernels(NORM_SOURCE, "rms_norm_bf16", "the CUDA RMSNorm kernel")

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Contiguous rows x [T, H] (and residual) -> (residual + x or None, the normed rows)."""
        out = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        if x.shape[0]:
            none = np.uint64(0)
            with self.kernels.on_torch_stream(x):
                self.kernels(f"rms_norm_{DTYPE_SUFFIX[x.dtype]}", x.device)(
                    (x.shape[0],),
                    (NORM_THREADS,),
                    (
                        ptr(out),
                        none if total is None else ptr(total),
                        ptr(x),
                        none if residual is None else ptr(residual),
                        ptr(weight),
                        np.int32(x.shape[1]),
                        np.float32(eps),
                    ),
                )
        return total, out

    def self_test(self) -> None:
        """3 bf16 rows of 96 (fewer than a block's threads, more than a warp's), with and without a residual: the
        sum bit for bit, the output within a last place of PyTorch's."""
        gen = torch.Generator().manual_seed(0)
        norm = RMSNorm(96, 1e-5).to(torch.bfloat16)
        norm.weight.data = torch.randn(96, generator=gen).to(torch.bfloat16)
        x, residual = (torch.randn(3, 96, generator=gen).mul(4).to(torch.bfloat16) for _ in range(2))
        dev = torch.device("cuda", torch.cuda.current_device())
        want_sum, want = norm(x, residual)
        got_sum, got = self(x.to(dev), residual.to(dev), norm.weight.to(dev), norm.eps)
        _, got_plain = self(x.to(dev), None, norm.weight.to(dev), norm.eps)
        close = all(
            torch.allclose(g.cpu().float(), w.float(), rtol=1e-2, atol=1e-2)
            for g, w in ((got, want), (got_plain, norm(x)))
        )
        if not (torch.equal(got_sum.cpu(), want_sum) and close):
            raise RuntimeError("the RMSNorm kernel's self-test output differs from PyTorch's")


@functools.cache
def norm_launcher() -> RmsNormKernel:
    return RmsNormKernel()


@torch.library.custom_op("orcinus::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return norm_launcher()(x, None, weight, eps)[1]


@_rms_norm_op.register_fake
def _(x, weight, eps) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("orcinus::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_launcher()(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def cuda_norm_available() -> bool:
    """Whether the RMSNorm kernel compiles and matches PyTorch here (a warning says why not, if it does not)."""
    return torch.cuda.is_available() and builds(
        lambda: norm_launcher().self_test(), "the CUDA RMSNorm kernel is unusable here, using PyTorch's"
    )


class CudaRMSNorm(RMSNorm):
    """RMSNorm (and the residual add before it) in one kernel (the same weight Parameter as the module it replaced)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        w = self.weight
        if (
            not x.is_cuda
            or x.dim() != 2
            or not x.is_contiguous()
            or x.dtype not in DTYPE_SUFFIX
            or w.dtype != x.dtype
            or x.shape[1] != w.numel()
            or (
                residual is not None
                and (residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous())
            )
        ):
            return super().forward(x, residual)
        if torch.compiler.is_compiling():  # op boundaries Inductor keeps
            if residual is None:
                return torch.ops.orcinus.rms_norm(x, w, self.eps)
            return torch.ops.orcinus.add_rms_norm(x, residual, w, self.eps)
        total, out = norm_launcher()(x, residual, w, self.eps)
        return out if residual is None else (total, out)


def use_cuda_rms_norm(module: nn.Module) -> None:
    """Swap every RMSNorm under `module` for CudaRMSNorm (sharing its weight)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (RMSNorm, HeadRMSNorm):  # a per-head norm too, where no fused RoPE takes it
                setattr(parent, name, child.on_weight_of(CudaRMSNorm))
