"""Served benchmarks: a live `orcinus serve` under load (throughput, latency, scheduling, speculation,
length-aware ordering, multi-turn, abuse, soak), alone or against llama-server."""
