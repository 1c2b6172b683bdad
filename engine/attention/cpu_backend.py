"""The CPU attention backend: cuda/paged_decode_attention_cpu.cpp for decoding requests, SDPA for prefills.

The PyTorch reference gathers every decoding request's whole context into a new tensor in every layer and
pads the batch to its longest context; this C++ op reads keys and values in place from the paged cache.
torch's extension builder compiles it on first use (~20 s, then cached under ~/.cache/torch_extensions);
`auto` falls back to the reference where it cannot (no C++ compiler, no ninja).
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

from engine.attention.torch_backend import TorchAttention

KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "paged_decode_attention_cpu.cpp"
# -march=native: the op is built on the machine that runs it. -ffast-math lets the exp and reduction loops
# vectorize; the kernel keeps every value finite, so nothing it assumes away occurs.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def _kernels():
    """The compiled extension module (built once per source version, loaded once per process)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    return load(name="orcinus_cpu_attention", sources=[str(KERNEL_SOURCE)], extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"], verbose=False)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI wheel's binary is not there unless the venv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def cpu_kernel_available() -> bool:
    """Whether the C++ op builds and loads here; `auto` uses the reference (with a warning) where it does not."""
    try:
        _kernels()
    except Exception as e:  # no compiler, no ninja, a failed build: any reason is a reason to fall back
        warnings.warn(f"the CPU attention kernel is unusable here, using the PyTorch reference: {e}", stacklevel=2)
        return False
    return True


class CpuAttention(TorchAttention):
    """The reference's prefill path (SDPA per chunk) with decoding requests through the paged C++ op."""

    def __init__(self):
        self._op = _kernels().paged_decode_attention

    def _decode(self, q, kv_cache, tables, lens):
        return self._op(q, kv_cache, tables, lens, q.shape[-1] ** -0.5)
