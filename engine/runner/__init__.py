"""Running one iteration on a device: device selection, staged inputs, CUDA graphs, the in-process executor.

Uses core, model and attention; knows nothing of processes or pipelines.
"""
