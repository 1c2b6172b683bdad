"""The block the server logs once its engine is ready: what runs, how big, and where to reach it."""

from __future__ import annotations

from engine.ipc.messages import EngineReady


def startup_block(
    ready: EngineReady, model_name: str, url: str | None, api_key: bool, replicas: int = 1, routing: str = ""
) -> str:
    """Plain lines, no colours: it lands in log files as often as on a terminal. With several replicas, the KV cache
    and batch lines are each replica's."""
    s, limits = ready.summary, ready.limits
    grid = [
        f"{n} {what}"
        for n, what in [(s.pipeline_stages, "pipeline stages"), (s.tensor_parallel_size, "tensor-parallel ranks")]
        if n > 1
    ]
    stages = ", " + " x ".join(grid) if grid else ""
    if replicas > 1:
        stages += f"; {replicas} data-parallel replicas, {routing} routing (each as below)"
    lines = [
        "Orcinus is ready",
        f"  model           {model_name} ({s.num_params / 1e6:,.1f}M parameters, max {limits.max_model_len} tokens)",
        f"  engine          {s.device}, {s.dtype}{stages}",
        (
            f"  KV cache        {limits.num_kv_blocks} blocks x {limits.block_size} tokens = "
            f"{limits.num_kv_blocks * limits.block_size:,} tokens"
            + (f"; {s.kv_cache_dtype}" if s.kv_cache_dtype else "")
        ),
        f"  batch           up to {s.max_num_seqs} sequences, {s.max_num_batched_tokens} tokens per iteration",
        f"  prefix caching  {'on' if s.prefix_caching else 'off'}",
    ]
    for i, choice in enumerate(s.defaults):
        lines.append(f"  {'defaults' if i == 0 else '':<16}{choice}")
    if s.kernels:
        lines.append(f"  kernels         {s.kernels}")
    if s.cpp_ops:
        lines.append(f"  C++ ops         {s.cpp_ops}")
    if url is not None:
        lines += [f"  API             {url}/v1{' (API key required)' if api_key else ''}", f"  chat page       {url}/"]
    return "\n".join(lines)
