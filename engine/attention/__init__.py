"""Ragged paged attention: the backend interface, the PyTorch reference, and the CuPy kernel backend.

Depends on nothing else in the engine; the model calls a backend once per layer.
"""
