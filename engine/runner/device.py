"""Where the engine runs: device and dtype resolution, and how much memory the KV cache gets."""

from __future__ import annotations

import torch

from engine.core.config import EngineConfig, ModelShape
from engine.core.defaults import choose_block_activations, choose_dtype
from engine.model.quantized import can_use_int16, int16_build_isa
from engine.runner.decode_graphs import whole_step_rows
from engine.runner.kv_dtype import kv_dtype, resolve_kv_cache_dtype

CPU_KV_CACHE_MEMORY = 512 * 2**20  # bytes: the CPU default, when the config gives none
GPU_TOKEN_BUDGET = 2048  # tokens per iteration on a GPU, when the config gives none
# On the CPU a step's time grows with its tokens, and every running stream waits for the whole step: 512-token
# prefill chunks keep most of 2048's prefill rate at a third of its longest step (docs/performance.md, CPU offline
# throughput: token budget).
CPU_TOKEN_BUDGET = 512


class DeviceError(ValueError):
    """The configured device or memory budget cannot be had on this machine."""


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Replace "auto" device and dtype (and a missing token budget) with concrete ones: a GPU in bfloat16
    when torch sees one, else the CPU in float32."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} was asked for, but torch sees no CUDA GPU here; use --device cpu")
    on_gpu = torch.device(device).type == "cuda"
    dtype = choose_dtype(config.dtype, on_gpu).value
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise DeviceError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    budget = config.max_num_batched_tokens or (GPU_TOKEN_BUDGET if on_gpu else CPU_TOKEN_BUDGET)
    config = config.with_(device=device, dtype=dtype, max_num_batched_tokens=budget)
    config = config.with_(kv_cache_dtype=resolve_kv_cache_dtype(config))
    return batch_invariant_attention(config) if config.batch_invariant else config


def batch_invariant_attention(config: EngineConfig) -> EngineConfig:
    """--batch-invariant runs on the CPU, its attention one query at a time (engine/attention/invariant.py)."""
    if torch.device(config.device).type != "cpu":
        raise DeviceError("--batch-invariant runs on the CPU only")
    if config.attention_backend not in ("auto", "cpu-invariant"):
        raise DeviceError(
            f"--batch-invariant brings its own attention; not --attention-backend {config.attention_backend}"
        )
    return config.with_(attention_backend="cpu-invariant")


def int16_isa(device: torch.device) -> str | None:
    """The instructions the int16-activation op runs on here (as its build says: VNNI where the CPU has it), or None."""
    return int16_build_isa() if can_use_int16(device) else None


def int16_activations(config: EngineConfig) -> bool:
    """Whether the block matmuls round their inputs to int16 (engine/model/quantized.py's Int16BlockLinear).

    "auto" does where the CPU has AVX-512 VNNI or AVX2; --batch-invariant too, since a row's rounding and sums are its own.
    """
    if config.block_activations == "float32":
        return False
    isa = int16_isa(torch.device(config.device))
    if config.block_activations == "int16" and isa is None:
        raise DeviceError(
            "--block-activations int16 needs a CPU with AVX-512 VNNI or AVX2 (engine/kernels/csrc/cpu/int16_matmul.cpp)"
        )
    return choose_block_activations(config.block_activations, isa).value == "int16"


def block_weights(config: EngineConfig, has_blocks: bool) -> bool:
    """Whether the projections keep the GGUF file's quantized blocks (engine/model/quantized.py) on this config.

    "auto" takes them on the CPU wherever the file has them: they are the float32 model's weights bit for bit, a
    quarter to a half of bfloat16's bytes, and the same sums at every batch size.
    """
    here = torch.device(config.device).type == "cpu" and config.dtype in ("float32", "bfloat16")
    if config.weights == "gguf" and not here:
        raise DeviceError("the GGUF block weights run on the CPU in float32 or bfloat16 only; use --weights dense")
    if config.weights == "gguf" and not has_blocks:
        raise DeviceError("--weights gguf needs a GGUF file with quantized tensors")
    return config.weights != "dense" and here and has_blocks


def activation_reserve(config: EngineConfig, shape: ModelShape, dtype: torch.dtype) -> int:
    """Bytes to keep free for one iteration's activations at the full token budget (an upper estimate).

    The widest live tensors are the fused gate/up output and its SwiGLU product, next to the residual
    stream, the QKV output and the attention output; the sampler holds a few float32 copies of the logits.
    The CUDA graph pool holds the same activations once more for the largest bucket.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_token = (3 * shape.intermediate_size + 4 * shape.hidden_size + qkv + shape.num_heads * shape.head_dim) * elem
    tokens = config.max_num_batched_tokens
    logits = config.max_num_seqs * shape.vocab_size * 4 * 4
    # Both graph runners capture after the KV cache is allocated (their segments write K/V into it): the pool keeps
    # one piecewise segment's activations at the largest bucket (at most the budget, or the configured bucket),
    # and one whole step's activations, logits and per-row block tables at its largest row bucket.
    whole_rows = whole_step_rows(config)
    graph_tokens = max(tokens, config.cuda_graph_max_tokens or 0) + whole_rows
    tables = whole_rows * -(-shape.max_position // config.block_size) * 4
    graphs = (
        0 if config.enforce_eager else per_token * graph_tokens + config.max_num_seqs * shape.vocab_size * 4 + tables
    )
    return per_token * tokens + logits + graphs


def gpu_kv_budget(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes for the KV cache: the engine's share of the GPU, less what is in use already and the reserve."""
    in_use = total - free  # weights, the CUDA context, and anything other processes hold
    budget = int(total * utilization) - in_use - reserve
    if budget <= 0:
        raise DeviceError(
            f"no GPU memory left for the KV cache: {in_use / 2**30:.1f} GiB in use and {reserve / 2**30:.1f} GiB "
            f"reserved for activations, of {utilization:.0%} of {total / 2**30:.1f} GiB; "
            "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return budget


def kv_cache_bytes(config: EngineConfig, shape: ModelShape) -> int:
    """The KV cache's size: the configured bytes, or on a GPU what is free after the weights are loaded."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    device = torch.device(config.device)
    if device.type != "cuda":
        return CPU_KV_CACHE_MEMORY
    # Cached blocks the weights' float32 staging copies left behind would otherwise count as in use.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(
        free, total, config.gpu_memory_utilization, activation_reserve(config, shape, getattr(torch, config.dtype))
    )


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes one block takes over `num_layers` layers (default: all of them)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = shape.num_layers if num_layers is None else num_layers
    return layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * elem


def num_kv_blocks(config: EngineConfig, shape: ModelShape, num_layers: int) -> int:
    """KV blocks the budget holds for `num_layers` layers (the runner adds one scratch block beyond it)."""
    return kv_cache_bytes(config, shape) // kv_bytes_per_block(shape, config.block_size, kv_dtype(config), num_layers)
