"""The CPU attention backend: cuda/paged_decode_attention_cpu.cpp for decoding requests, SDPA for prefills.

The PyTorch reference gathers every decoding request's whole context into a new tensor in every layer and
pads the batch to its longest context; this C++ op reads keys and values in place from the paged cache.
torch's extension builder compiles it on first use (engine/attention/cpp_extension.py); `auto` falls back to
the reference where it cannot (no C++ compiler, no ninja).
"""

from __future__ import annotations

from engine.attention.backend import AttentionParams
from engine.attention.cpp_extension import builds, load_cpu_extension
from engine.attention.torch_backend import TorchAttention


def _kernels():
    return load_cpu_extension("orcinus_cpu_attention")


def cpu_kernel_available() -> bool:
    """Whether the C++ op builds and loads here; `auto` uses the reference (with a warning) where it does not."""
    return builds(_kernels, "the CPU attention kernel is unusable here, using the PyTorch reference")


class CpuAttention(TorchAttention):
    """The reference's prefill path (SDPA per chunk) with decoding requests through the paged C++ op."""

    label = "C++ paged decode, SDPA prefill"

    def __init__(self):
        self._op = _kernels().paged_decode_attention

    def _decode(self, q, kv_cache, tables, requests, lens, params: AttentionParams):
        if q.shape[-1] % 8:  # the op's vectors take 8 lanes of a head at a time
            return TorchAttention._decode(q, kv_cache, tables, requests, lens, params)
        return self._op(q, kv_cache, tables, requests, lens, params.scale, params.sliding_window or 0,
                        params.logit_softcap or 0.0)
