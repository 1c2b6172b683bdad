"""The CUDA kernels (csrc/cuda/*.cu), compiled by NVRTC through CuPy once per process and launched on PyTorch's
current stream.

Kernels run on the tensors' own memory (raw `data_ptr()`s) and on the stream PyTorch is using, so they order
with the surrounding torch ops (and land in a CUDA graph being captured) with no copy and no synchronisation.
CuPy is imported lazily so this module imports on machines without it; using it there raises a RuntimeError
that says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

CUDA_SOURCES = Path(__file__).parent / "csrc" / "cuda"
NVRTC_OPTIONS = ("-std=c++17",)  # CuPy adds -ftz=true and the device's -arch (tests/test_cuda_kernels.py mirrors them)
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # entry points' names end so
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def import_cupy(user: str):
    """CuPy, or a RuntimeError naming `user` (what needs it)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy build that cannot load its CUDA libraries
        raise RuntimeError(f"{user} needs CuPy and an NVIDIA GPU: cannot import cupy ({e})") from e
    return cupy


class NvrtcKernels:
    """The functions of one .cu file; `probe` is one of them, compiled up front so a bad build fails at once."""

    _modules: ClassVar[
        dict[tuple, object]
    ] = {}  # (source, options) -> compiled RawModule: NVRTC runs once per process each

    def __init__(self, source: Path, probe: str, user: str, options: tuple[str, ...] = ()):
        if not torch.cuda.is_available():
            raise RuntimeError(f"{user} needs CuPy and an NVIDIA GPU: torch sees no CUDA device")
        self.cp = import_cupy(user)
        self.source, self.probe, self.options = source, probe, tuple(options)  # options: -D overrides, say
        self._functions: dict = {}  # (name, device) -> function; compiled on first use
        self._streams: dict = {}  # (device, torch stream pointer) -> CuPy's handle on that same stream

    def _module(self):
        """NVRTC finds cuda_fp16.h / cuda_bf16.h itself in recent CUDA; if it does not, retry with the include
        directories of a CUDA toolkit or of NVIDIA's pip packages."""
        key = (self.source, self.options)
        if key in self._modules:
            return self._modules[key]
        code, errors = kernel_source(self.source), []
        for extra in [()] + [(f"-I{d}",) for d in _header_dirs(self.cp)]:
            try:
                module = self.cp.RawModule(code=code, options=(*NVRTC_OPTIONS, *self.options, *extra))
                module.get_function(self.probe)  # RawModule compiles lazily: force it
            except Exception as e:  # cupy.cuda.compiler.CompileException, mostly
                errors.append(f"{' '.join(extra) or 'no -I'}: {e}")
                continue
            self._modules[key] = module
            return module
        raise RuntimeError(f"cannot compile {self.source} with NVRTC:\n" + "\n".join(errors))

    def __call__(self, name: str, device: torch.device):
        """Function `name`, loaded for `device` (a loaded function belongs to the device current when loaded)."""
        key = (name, device.index)
        if key not in self._functions:
            with self.cp.cuda.Device(device.index):
                self._functions[key] = self._module().get_function(name)
        return self._functions[key]

    def on_torch_stream(self, t: torch.Tensor) -> contextlib.ExitStack:
        """Make t's device and PyTorch's current stream on it CuPy's current ones, so launches order
        correctly with the surrounding torch ops without any synchronisation."""
        stack = contextlib.ExitStack()
        key = (t.device.index, torch.cuda.current_stream(t.device).cuda_stream)
        if key not in self._streams:
            # One wrapper per stream, made once: CuPy 14 deprecates ExternalStream (its from_external wants
            # a __cuda_stream__ object instead) and warns on every construction. It still works in 13 and 14.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self._streams[key] = self.cp.cuda.ExternalStream(key[1], key[0])
        stack.enter_context(self.cp.cuda.Device(t.device.index))
        stack.enter_context(self._streams[key])
        return stack


def kernel_source(path: Path) -> str:
    """A .cu file with its own headers (`#include "x.cuh"`, beside it) pasted in: NVRTC gets one self-contained text,
    and CuPy's compile cache, keyed by that text, sees a header's change."""
    return _LOCAL_INCLUDE.sub(lambda m: kernel_source(path.parent / m.group(1)), path.read_text())


def _header_dirs(cp) -> list[Path]:
    """Directories holding cuda_bf16.h: the toolkit CuPy uses, then the nvidia-* pip packages."""
    candidates = []
    if cp.cuda.get_cuda_path():
        candidates.append(Path(cp.cuda.get_cuda_path()) / "include")
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        candidates += sorted(Path(root).glob("*/include"))
    return [d for d in candidates if (d / "cuda_bf16.h").exists()]


def ptr(t: torch.Tensor) -> np.uint64:
    """A device pointer as a kernel argument (8 bytes, exactly what a `T*` parameter takes)."""
    return np.uint64(t.data_ptr())
