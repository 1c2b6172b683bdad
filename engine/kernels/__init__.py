"""The engine's native kernels: their sources (csrc/cpu: C++ ops for the CPU; csrc/cuda: CUDA kernels) and the code
that builds and loads them (cpu_ops: torch extensions, prebuilt by the install or built at run time; nvrtc: CUDA
compiled through CuPy at run time).

Imports nothing else of the engine: attention/ and model/ call these kernels and own the fallbacks around them.
"""
