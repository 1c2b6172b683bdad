"""Ragged paged attention: the backend interface, the PyTorch reference, the CuPy kernel backend (with
variable-length flash attention for prefills) and the CPU C++ op.

Depends on nothing else in the engine; the model calls a backend once per layer.
"""
