"""Ragged paged attention: the backend interface, the PyTorch reference, the CUDA backend (with variable-length
flash attention for prefills) and the CPU backend, each over its kernel in engine/kernels/.

Depends on nothing else in the engine but those kernels; the model calls a backend once per layer.
"""
