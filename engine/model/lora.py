"""LoRA adapters: PEFT files read to host tensors, and the projections that add each row's adapter delta.

Every targeted projection of the model is wrapped once (`LoraLinear`); it holds the A and B matrices of all
`max_loras` slots stacked, each padded to `max_lora_rank`. A step groups its adapter rows by slot once (segments of
equal length, padded): each projection then runs one batched shrink (each slot's rows @ its A, every slice at once),
scales it, and one batched expand per output slice (q/k/v of the fused QKV, gate/up of the fused MLP input), then
gathers each row's delta back into place (a base row reads a pad's, zero): the same ops whatever the mix, no loop
over adapters or requests, and a row computes only its own adapter's columns. On the CPU in float32 one C++ call per
projection does all of it instead (engine/kernels/csrc/cpu/lora_ops.cpp), with no padding and base rows untouched.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.core.lora_pool import AdapterError
from engine.kernels.availability import builds
from engine.kernels.cpu_ops import load_cpu_extension

# PEFT's module names -> (the fused projection of ours that holds it, its slice index there).
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class LoraAdapter:
    """One adapter on the host: per (layer, PEFT module) its A [r, in] and B [out, r], and its scale."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str, num_layers: int, max_rank: int, heads: tuple[int, int] | None = None) -> LoraAdapter:
    """A PEFT LoRA directory, or llama.cpp's LoRA GGUF file (`heads`: the model's query and key/value head counts),
    -> host tensors (float32); AdapterError for what this engine cannot serve."""
    root = Path(path)
    if root.is_file():
        from engine.model.lora_gguf import read_gguf_adapter

        return _finite(LoraAdapter(*read_gguf_adapter(path, num_layers, max_rank, heads)), path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"no LoRA adapter at {path}: expected {CONFIG_FILE} and {WEIGHTS_FILE}, or a llama.cpp LoRA .gguf file"
        )
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"unreadable {CONFIG_FILE} in {path}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} is a {config.get('peft_type')} adapter, not LORA")
    unsupported = [
        k
        for k in ("use_dora", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern")
        if config.get(k)
    ]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(f"the adapter at {path} uses what is not supported: {', '.join(unsupported)}")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 0 < rank <= max_rank:
        raise AdapterError(f"the adapter at {path} has rank {rank}; this server takes ranks up to {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank  # as PEFT scales
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(root / WEIGHTS_FILE), device="cpu")
    except Exception as e:
        raise AdapterError(f"unreadable {WEIGHTS_FILE} in {path}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m[2] not in TARGETS or int(m[1]) >= num_layers:
            raise AdapterError(f"the adapter at {path} holds {key}: only q/k/v/o/gate/up/down projections are served")
        halves.setdefault((int(m[1]), m[2]), {})[m[3]] = t.float()
    weights = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise AdapterError(f"the adapter at {path} has no rank-{rank} A and B pair for layer {where[0]} {where[1]}")
        weights[where] = ab["A"], ab["B"]
    if not weights:
        raise AdapterError(f"the adapter at {path} holds no LoRA weights")
    return _finite(LoraAdapter(rank, scale, weights), path)


def _finite(adapter: LoraAdapter, path: str) -> LoraAdapter:
    """The adapter, or AdapterError if it holds a NaN or an infinity: the PyTorch path's pads (whose delta the base
    model's rows read) multiply zeros by every slot's B, so such a value would reach other requests' rows."""
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(
                f"the adapter at {path} holds non-finite values (NaN or infinity) in layer {layer} {module}"
            )
    return adapter


class RowAdapters:
    """This step's adapter rows grouped by slot: `order` [num_slots * seg_len] names the row at each segment position
    (row 0 at a pad), `scale` [num_slots, seg_len, 1] its adapter's scale, `pad` where a position is a pad, and
    `inverse` [rows] each row's position (a base row's: a pad). `order` is None when no row uses an adapter (the
    projections then run as without LoRA, bit for bit). The C++ op's view of the same: `mine` [M] the adapter rows
    by slot, `starts` [segments + 1] where each slot's begin there, `slots` [segments] which, `row_scale` [M]."""

    def __init__(self) -> None:
        self.order: torch.Tensor | None = None
        self.inverse = self.scale = self.pad = None
        self.mine = self.starts = self.slots = self.row_scale = None
        self.num_slots = 0


@functools.cache
def _kernel():
    """The C++ op, or None where it does not build here."""
    load = functools.partial(load_cpu_extension, "orcinus_cpu_lora")
    return load() if builds(load, "the CPU LoRA op is unusable here, using PyTorch's") else None


class LoraLinear(nn.Module):
    """A projection (dense, packed or quantized: any module giving float rows) plus each row's adapter delta, per
    output slice."""

    def __init__(self, base: nn.Module, slices: list[int], in_features: int, rows: RowAdapters, slots: int, rank: int):
        super().__init__()
        self.base, self.rows = base, rows
        self.sizes, self.rank, self.in_features = slices, rank, in_features
        self.offsets = [sum(slices[:i]) for i in range(len(slices))]
        p = next(base.parameters(), None)
        p = p if p is not None else next(base.buffers())
        dtype = p.dtype if p.is_floating_point() else torch.float32
        # A [slots, in, slices x rank]: one batched shrink for every slice of each slot's rows; B per slice
        # [slots, rank, out_slice].
        self.register_buffer(
            "a", torch.zeros(slots, in_features, len(slices) * rank, dtype=dtype, device=p.device), False
        )
        for i, size in enumerate(slices):
            self.register_buffer(f"b{i}", torch.zeros(slots, rank, size, dtype=dtype, device=p.device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.rows
        if rows.order is None:
            return y
        if (
            rows.mine is not None
            and y.dtype == torch.float32
            and x.dtype == torch.float32
            and x.dim() == y.dim() == 2
            and y.stride(1) == 1
            and not torch.compiler.is_compiling()
        ):
            bs = [getattr(self, f"b{i}") for i in range(len(self.sizes))]
            _kernel().lora_add(
                x.contiguous(), y, self.a, bs, self.offsets, rows.mine, rows.starts, rows.slots, rows.row_scale
            )
            return y
        num, r = rows.num_slots, self.rank
        xs = x.index_select(0, rows.order).view(num, -1, x.shape[1])
        # A pad reads row 0: zeroed after the shrink, so no value of row 0's (inf or nan) reaches a base row.
        xa = torch.bmm(xs, self.a[:num]).mul_(rows.scale).masked_fill_(rows.pad, 0)
        for i, (off, size) in enumerate(zip(self.offsets, self.sizes)):
            delta = torch.bmm(xa[:, :, i * r : (i + 1) * r], getattr(self, f"b{i}")[:num])
            y[:, off : off + size] += delta.view(-1, size).index_select(0, rows.inverse)
        return y


class LoraSlots:
    """The model's LoRA-wrapped projections and the adapters resident in their slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = RowAdapters()
        self.layers: list[dict[str, LoraLinear]] = []
        for layer in model.layers:
            s = layer.shape
            widths = {
                "qkv_proj": ([layer.q_size, layer.kv_size, layer.kv_size], s.hidden_size),
                "o_proj": ([s.hidden_size], layer.q_size),
                "gate_up_proj": ([s.intermediate_size, s.intermediate_size], s.hidden_size),
                "down_proj": ([s.hidden_size], s.intermediate_size),
            }
            wrapped = {}
            for name, (slices, fan_in) in widths.items():
                wrapped[name] = LoraLinear(getattr(layer, name), slices, fan_in, self.rows, max_loras, max_rank)
                setattr(layer, name, wrapped[name])
            self.layers.append(wrapped)
        self.slot_scales = np.zeros(max_loras, np.float32)  # each slot's adapter's scale

    @torch.no_grad()
    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into `slot`, over whatever was there (its untargeted projections zeroed)."""
        self.check(adapter)
        r = adapter.rank
        for wrapped in self.layers:
            for proj in wrapped.values():
                proj.a[slot] = 0
                for j in range(len(proj.sizes)):
                    getattr(proj, f"b{j}")[slot] = 0
        for (layer, module), (a_host, b_host) in adapter.weights.items():
            name, j = TARGETS[module]
            proj = self.layers[layer][name]
            proj.a[slot].view(proj.in_features, len(proj.sizes), self.max_rank)[:, j, :r] = a_host.T.to(proj.a)
            getattr(proj, f"b{j}")[slot, :r] = b_host.T.to(proj.a)
        self.slot_scales[slot] = adapter.scale

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError if the adapter's matrices do not fit this model's projections."""
        for (layer, module), (a_host, b_host) in adapter.weights.items():
            if layer >= len(self.layers):
                raise AdapterError(f"the adapter has layer {layer}; the model has {len(self.layers)}")
            name, j = TARGETS[module]
            proj = self.layers[layer][name]
            if a_host.shape[1] != proj.in_features or b_host.shape[0] != proj.sizes[j]:
                raise AdapterError(
                    f"the adapter's {module} of layer {layer} is ({b_host.shape[0]}, {a_host.shape[1]}) (out, in);"
                    f" the model's is ({proj.sizes[j]}, {proj.in_features})"
                )

    def set_rows(self, slots: list[int] | None, rows_per_request: list[int]) -> None:
        """This step's rows: request i's `rows_per_request[i]` rows use slot `slots[i]` (-1: the base model)."""
        rows = self.rows
        if not slots or max(slots) < 0:
            rows.order = None
            return
        row_slot = np.repeat(np.asarray(slots), rows_per_request)
        num = int(row_slot.max()) + 1
        counts = np.bincount(row_slot[row_slot >= 0], minlength=num)
        seg = int(counts.max())
        if (row_slot < 0).any() and (counts == seg).all():
            seg += 1  # a pad for the base rows to read their (zero) delta from
        mine = np.flatnonzero(row_slot >= 0)
        mine = mine[np.argsort(row_slot[mine], kind="stable")]  # by slot, in row order within one
        slot = row_slot[mine]
        starts = np.cumsum(counts) - counts
        pos = slot * seg + np.arange(len(mine)) - starts[slot]
        order = np.zeros(num * seg, np.int64)
        scale = np.zeros(num * seg, np.float32)
        pad = np.ones(num * seg, bool)
        order[pos], scale[pos], pad[pos] = mine, self.slot_scales[slot], False
        inverse = np.full(len(row_slot), int(np.argmax(pad)), np.int64)
        inverse[mine] = pos
        like = self.layers[0]["o_proj"].a
        rows.num_slots = num
        rows.order = torch.from_numpy(order).to(like.device)
        rows.inverse = torch.from_numpy(inverse).to(like.device)
        rows.scale = torch.from_numpy(scale).to(like).view(num, seg, 1)
        rows.pad = torch.from_numpy(pad).to(like.device).view(num, seg, 1)
        rows.mine = rows.starts = rows.slots = rows.row_scale = None
        if like.device.type == "cpu" and like.dtype == torch.float32 and _kernel() is not None:
            present = np.flatnonzero(counts)
            rows.mine = torch.from_numpy(mine)
            rows.slots = torch.from_numpy(present.astype(np.int64))
            rows.starts = torch.from_numpy(np.concatenate([[0], np.cumsum(counts[present])]).astype(np.int64))
            rows.row_scale = torch.from_numpy(np.ascontiguousarray(self.slot_scales[slot]))
