"""LoRA adapters over a grid of ranks: each rank's part of an adapter, and adapters as bytes for the pipeline frames.

A pipeline stage holds its own layers' A and B (renumbered from its first layer). Under tensor parallelism an
adapter is split as its base weight: for the column-parallel projections (Q, K, V, gate, up) A is whole and B is
cut along its outputs with the base's rows; for the row-parallel ones (output, down) A is cut along its inputs
and B is whole, so each rank's delta is a partial sum that the base's all-reduce adds up with the projection's.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from engine.core.config import ModelShape
from engine.core.lora_pool import AdapterError
from engine.model.lora import LoraAdapter
from engine.model.sharding import TensorShard

ROW_PARALLEL = ("o_proj", "down_proj")


def module_widths(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Each PEFT module's (out, in) in a model of `shape` (the whole model's, or a rank's local shape)."""
    h, m = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (m, h),
        "up_proj": (m, h),
        "down_proj": (h, m),
    }


def check_adapter(adapter: LoraAdapter, shape: ModelShape) -> None:
    """AdapterError if the adapter's matrices do not fit a model of `shape` (where no process holds the layers)."""
    widths = module_widths(shape)
    for (layer, module), (a, b) in adapter.weights.items():
        out, fan_in = widths[module]
        if a.shape[1] != fan_in or b.shape[0] != out:
            raise AdapterError(
                f"the adapter's {module} of layer {layer} is ({b.shape[0]}, {a.shape[1]}) (out, in);"
                f" the model's is ({out}, {fan_in})"
            )


def adapter_part(adapter: LoraAdapter, span: range, shard: TensorShard) -> LoraAdapter:
    """The part of `adapter` a rank holding layers `span` (numbered from 0 there) and shard `shard` of each needs."""
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        if layer not in span:
            continue
        if shard.size > 1:
            if module in ROW_PARALLEL:
                a = a.chunk(shard.size, dim=1)[shard.rank]
            else:
                b = b.chunk(shard.size, dim=0)[shard.rank]
        weights[layer - span.start, module] = a.contiguous(), b.contiguous()
    return LoraAdapter(adapter.rank, adapter.scale, weights)


def adapter_bytes(adapter: LoraAdapter) -> bytes:
    """The adapter's matrices as safetensors bytes (its rank and scale travel beside them)."""
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        tensors[f"{layer}.{module}.A"], tensors[f"{layer}.{module}.B"] = a, b
    return save_tensors(tensors)


def adapter_from_bytes(data: bytes, rank: int, scale: float) -> LoraAdapter:
    tensors = load_tensors(data)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key in tensors:
        layer, module, half = key.split(".")
        if half == "A":
            weights[int(layer), module] = tensors[key], tensors[f"{layer}.{module}.B"]
    return LoraAdapter(rank, scale, weights)
