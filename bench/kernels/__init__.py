"""Kernel micro-benchmarks: paged attention (CPU and CUDA), block-quantized matmuls and their block types."""
