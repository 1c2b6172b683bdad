"""Picks an attention backend by name: the CuPy kernels on a GPU, else the PyTorch reference."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttention


def _cuda_backend():
    from engine.attention.cupy_backend import CudaAttention  # lazy: CuPy is optional

    return CudaAttention()


def _auto_backend():
    from engine.attention.cupy_backend import cuda_backend_available

    return _cuda_backend() if cuda_backend_available() else TorchAttention()


# "auto": the CUDA kernels when torch sees a GPU and CuPy imports, else the PyTorch reference.
BACKENDS = {"torch": TorchAttention, "cuda": _cuda_backend, "auto": _auto_backend}


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
