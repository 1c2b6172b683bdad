"""Benchmarks, profilers and client checks of Orcinus, run as `python -m bench.<group>.<script>`."""
