"""Benchmarks, profilers and client checks of Orcinus: scripts run from the checkout's root as
`python -m bench.<group>.<name>`, sharing bench.common. Not part of the installed package."""
