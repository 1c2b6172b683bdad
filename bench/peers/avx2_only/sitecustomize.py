"""Run at start-up by every Python process with this folder on PYTHONPATH: its C++ CPU ops come from their
-march=haswell builds (AVX2, no AVX-512), so that a server on an AVX-512 machine runs the code an AVX2-only CPU
would. With torch's own kernels held to AVX2 as well, an `orcinus serve` variant (bench/peers/README.md):

    PYTHONPATH=bench/peers/avx2_only ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
"""

from engine.kernels import cpu_ops

cpu_ops.load_for("haswell")
