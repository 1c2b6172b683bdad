"""RoPE and the K/V cache write as one CUDA kernel (cuda/rope_write_kv.cu), in place of the PyTorch formula on a GPU.

Traced by torch.compile, the formula and the cache write were ~10 kernels a layer on an H200 (~14 us at batch 1,
~22 us at batch 64: a tenth of a llama-1b decode step, benchmarks/gpu/2026-11-27-h200/); this is one launch.
It gives the formula's eager bits (products rounded to the dtype, then their sum). Under torch.compile it is a
custom op that mutates the cache, so Inductor calls it in place (as it does `write_kv`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from engine.attention.cpp_extension import SOURCES, builds
from engine.attention.nvrtc import DTYPE_SUFFIX, NvrtcKernels, ptr
from engine.model.token_ops import Rotary

KERNEL_SOURCE = SOURCES / "rope_write_kv.cu"
THREADS = 128  # kThreads in the kernel: each thread rotates (or copies) one pair of a head's elements


def kernel_names() -> list[str]:
    """Every function of cuda/rope_write_kv.cu this module may launch."""
    return [f"rope_write_kv_{s}" for s in DTYPE_SUFFIX.values()]


class RopeWriteKV:
    """The kernel's launcher: one per process (the compiled module and its per-device functions)."""

    def __init__(self) -> None:
        self.kernels = NvrtcKernels(KERNEL_SOURCE, "rope_write_kv_bf16", "the CUDA RoPE kernel")

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        rows, d = qkv.shape[0], table.shape[-1]
        q = qkv.new_empty((rows, num_heads, d))
        if rows == 0:
            return q
        pairs = (num_heads + 2 * num_kv_heads) * (d // 2)
        with self.kernels.on_torch_stream(qkv):
            self.kernels(f"rope_write_kv_{DTYPE_SUFFIX[qkv.dtype]}", qkv.device)(
                (rows, -(-pairs // THREADS)), (THREADS,),
                (ptr(q), ptr(kv_cache), ptr(qkv), ptr(table), ptr(positions), ptr(slot_mapping),
                 np.int64(qkv.stride(0)), np.int64(kv_cache.shape[2] * kv_cache.shape[3]),
                 np.int32(num_heads), np.int32(num_kv_heads), np.int32(d)),
            )
        return q

    def self_test(self) -> None:
        """Rotate 3 rows (GQA, bf16, strided QKV rows) and compare bit for bit with the PyTorch formula."""
        gen = torch.Generator().manual_seed(0)
        rotary = Rotary(64, 10000.0, 32).to(torch.bfloat16)
        wide = torch.randn(3, 6 * 64 + 8, generator=gen).to(torch.bfloat16)
        qkv = wide[:, :6 * 64]  # 4 + 2 x 1 heads, rows strided as a wider projection's output would be
        positions, slots = torch.tensor([0, 7, 31]), torch.tensor([5, 16, 2])
        dev = torch.device("cuda", torch.cuda.current_device())
        cache = torch.zeros(2, 1, 2, 16, 64, dtype=torch.bfloat16)
        got_cache = cache.to(dev)
        got_q = self(wide.to(dev)[:, :6 * 64], positions.to(dev), rotary.table.to(dev), got_cache, slots.to(dev), 4, 1)
        q = rotary.rope_write_kv(qkv, positions, cache, slots, 4, 1)
        if not (torch.equal(got_q.cpu(), q) and torch.equal(got_cache.cpu(), cache)):
            raise RuntimeError("the RoPE kernel's self-test output differs from the PyTorch formula")


@functools.cache
def launcher() -> RopeWriteKV:
    """The process's launcher: NVRTC compiles the source once."""
    return RopeWriteKV()


@torch.library.custom_op("orcinus::rope_write_kv", mutates_args=("kv_cache",))
def _rope_write_kv_op(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    return launcher()(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads)


@_rope_write_kv_op.register_fake
def _(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], num_heads, table.shape[-1]))


def cuda_rope_available() -> bool:
    """Whether the kernel compiles and matches the formula here (a warning says why not, if it does not)."""
    return torch.cuda.is_available() and builds(
        lambda: launcher().self_test(), "the CUDA RoPE kernel is unusable here, using PyTorch's ops")


class CudaRotary(Rotary):
    """RoPE and the cache write in one kernel (the same table buffer as the module it replaced)."""

    def rope_write_kv(self, qkv, positions, kv_cache, slot_mapping, num_heads, num_kv_heads):
        if (not qkv.is_cuda or qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.dtype not in DTYPE_SUFFIX
                or kv_cache.dtype != qkv.dtype or self.table.dtype != qkv.dtype or not kv_cache.is_contiguous()
                or not self.table.is_contiguous()
                or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64):
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
