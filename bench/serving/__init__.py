"""Served benchmarks: `orcinus serve` under load, compared with other servers and across its own options."""
