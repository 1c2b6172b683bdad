"""Offline benchmarks and profilers: the engine driven in-process, no gateway (steps, prefill, sampler,
host time, memory, speculation's ceiling), and a synthetic GGUF maker for them."""
