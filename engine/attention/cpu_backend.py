"""The CPU attention backend: engine/kernels/csrc/cpu/paged_decode_attention.cpp for decoding requests and prompts
of up to 1024 keys, SDPA for longer prompts.

The PyTorch reference gathers every decoding request's whole context into a new tensor in every layer and
pads the batch to its longest context; this C++ op reads keys and values in place from the paged cache.
torch's extension builder compiles it on first use (engine/kernels/cpu_ops.py); `auto` falls back to
the reference where it cannot (no C++ compiler, no ninja).
"""

from __future__ import annotations

from engine.attention.backend import AttentionParams
from engine.attention.torch_backend import TorchAttention
from engine.kernels.availability import builds
from engine.kernels.cpu_ops import load_cpu_extension


def _kernels():
    return load_cpu_extension("orcinus_cpu_attention")


def cpu_kernel_available() -> bool:
    """Whether the C++ op builds and loads here; `auto` uses the reference (with a warning) where it does not."""
    return builds(_kernels, "the CPU attention kernel is unusable here, using the PyTorch reference")


class CpuAttention(TorchAttention):
    """Every query of a request with a short context through the paged C++ op (a prompt token at position p is a
    decode query against its p + 1 keys), a long prompt's chunk through SDPA."""

    label = "C++ paged, SDPA for prompts past 1024 keys"
    # Past about this many keys SDPA's blocked kernel beats one query at a time; below it the op wins, sparing
    # SDPA's gathered copy of the keys and its mask (docs/performance.md, Kernels: prompts through the paged op).
    decode_like_context = 1024

    def __init__(self):
        self._op = _kernels().paged_decode_attention

    def _decode(self, q, kv_cache, tables, requests, lens, params: AttentionParams):
        if q.shape[-1] % 8:  # the op's vectors take 8 lanes of a head at a time
            return TorchAttention._decode(q, kv_cache, tables, requests, lens, params)
        return self._op(
            q, kv_cache, tables, requests, lens, params.scale, params.sliding_window or 0, params.logit_softcap or 0.0
        )
