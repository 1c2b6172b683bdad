"""What the KV cache stores: the compute dtype, or on the CPU a 16-bit copy of float32's keys and values."""

from __future__ import annotations

import torch

from engine.core.config import EngineConfig

# What `--kv-cache-dtype auto` stores under float32 activations on the CPU. float16 rather than bfloat16: its 10-bit
# mantissa kept tests/test_fidelity.py's budget with fewer near-tie flips on the bundled model and on each family's tiny
# checkpoint (tests/test_kv_fidelity.py), the attention widens it in registers as cheaply, and it is llama.cpp's
# default too. Its range (65504) is far above the keys and values of these models.
CPU_AUTO_KV_DTYPE = "float16"
NARROW = ("bfloat16", "float16")


class KvDtypeError(ValueError):
    """The asked KV cache dtype cannot hold this engine's keys and values."""


def resolve_kv_cache_dtype(config: EngineConfig) -> str:
    """The KV cache dtype for a config whose device and compute dtype are resolved."""
    asked, compute = config.kv_cache_dtype, config.dtype
    on_cpu = torch.device(config.device).type == "cpu"
    if asked == "auto":
        return CPU_AUTO_KV_DTYPE if on_cpu and compute == "float32" else compute
    if asked == compute:
        return asked
    if asked not in NARROW:
        raise KvDtypeError(f"unknown KV cache dtype {asked!r}; use auto, float32, bfloat16 or float16")
    # The CPU ops widen a 16-bit cache under float32 queries; the GPU kernels read the compute dtype only.
    if not on_cpu:
        raise KvDtypeError(f"--kv-cache-dtype {asked} runs on the CPU only; on a GPU the cache holds --dtype's values")
    if compute != "float32":
        raise KvDtypeError(f"--kv-cache-dtype {asked} needs --dtype float32 (the cache holds {compute} values here)")
    return asked


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """The torch dtype of a resolved config's KV cache ("auto" read as the compute dtype)."""
    name = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    return getattr(torch, name)


def describe_kv_dtype(asked: str, config: EngineConfig) -> str:
    """The cache's dtype and why, for the startup block: `asked` is the flag's value, `config` resolved."""
    name = config.kv_cache_dtype
    if asked != "auto":
        return f"{name}, as asked"
    if name == config.dtype:
        return f"{name}, the compute dtype (auto)"
    return (
        f"{name} (auto: half float32's bytes, twice the tokens; the float32 model's greedy tokens kept, "
        "tests/test_fidelity.py; --kv-cache-dtype float32 for the cache exact)"
    )
