"""Picks an attention backend by name and device: the native kernels where they run, else the PyTorch reference."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttention


def _cuda_backend():
    from engine.attention.cuda_backend import CudaAttention  # lazy: CuPy is optional

    return CudaAttention()


def _cpu_backend():
    from engine.attention.cpu_backend import CpuAttention  # lazy: builds a C++ op on first use

    return CpuAttention()


def _auto_backend(device_type: str) -> AttentionBackend:
    if device_type == "cuda":
        from engine.attention.cuda_backend import cuda_backend_available

        return _cuda_backend() if cuda_backend_available() else TorchAttention()
    from engine.attention.cpu_backend import cpu_kernel_available

    return _cpu_backend() if cpu_kernel_available() else TorchAttention()


def _cpu_invariant_backend():
    from engine.attention.invariant import BatchInvariantAttention  # lazy: builds a C++ op on first use

    return BatchInvariantAttention()


# "auto": the kernel for the engine's device (CuPy on a GPU, the C++ op on the CPU) when it builds and runs,
# else the PyTorch reference. "cpu-invariant" is --batch-invariant's (engine/runner/device.py sets it).
BACKENDS = {
    "torch": TorchAttention,
    "cuda": _cuda_backend,
    "cpu": _cpu_backend,
    "cpu-invariant": _cpu_invariant_backend,
}


def make_backend(name: str, device_type: str = "cpu") -> AttentionBackend:
    """The backend `name` for an engine on `device_type` ("cpu" or "cuda")."""
    if name == "auto":
        return _auto_backend(device_type)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS) + ['auto']}")
    return BACKENDS[name]()
