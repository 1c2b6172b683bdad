"""llama.cpp's LoRA files (convert_lora_to_gguf.py's GGUF: general.type "adapter", adapter.type "lora") read to the
same host tensors as a PEFT adapter.

llama.cpp keeps PEFT's matrices as they are (`blk.N.attn_q.weight.lora_a` is A [rank, in], `.lora_b` is B [out,
rank], in numpy's order), scales by `adapter.lora.alpha / rank` (1 without an alpha), and, for Llama, stores the
rows of Q's and K's B interleaved as it does the base model's Q and K weights: undone here as the GGUF loader does.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf.quants import dequantize

from engine.core.lora_pool import AdapterError
from engine.model.loader import _unpermute
from engine.model.model_files import GGUFReader

# llama.cpp's tensor names -> PEFT's module names.
_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def read_gguf_adapter(
    path: str, num_layers: int, max_rank: int, heads: tuple[int, int] | None
) -> tuple[int, float, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    """A llama.cpp LoRA GGUF file -> its rank, scale and float32 (A, B) by (layer, PEFT module); `heads`: the model's
    (query, key/value) head counts, to restore a Llama adapter's Q/K rows. AdapterError for what cannot be served."""
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise AdapterError(f"unreadable GGUF file {path}: {e}") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kind, adapter_kind = field("general.type"), field("adapter.type")
    if kind != "adapter" or adapter_kind != "lora":
        raise AdapterError(
            f"{path} is not a LoRA adapter GGUF (general.type {kind!r}, adapter.type {adapter_kind!r};"
            " expected 'adapter' and 'lora')"
        )
    permuted = field("general.architecture") == "llama"  # as llama.cpp's converter wrote the base model's Q and K
    if permuted and heads is None:
        raise AdapterError(f"{path} is a Llama adapter: reading it needs the model's head counts")
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _NAME.match(t.name)
        if m is None or m[2] not in _MODULES or int(m[1]) >= num_layers:
            raise AdapterError(
                f"the adapter at {path} holds {t.name}: only q/k/v/o/gate/up/down projections are served"
            )
        try:
            w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        except NotImplementedError:
            raise AdapterError(f"the adapter at {path} stores {t.name} as {t.tensor_type.name}") from None
        halves.setdefault((int(m[1]), _MODULES[m[2]]), {})[m[3]] = w
    ranks = {ab["a"].shape[0] for ab in halves.values() if "a" in ab}
    if not halves:
        raise AdapterError(f"the adapter at {path} holds no LoRA weights")
    if len(ranks) != 1:
        raise AdapterError(f"the adapter at {path} has ranks {sorted(ranks)}: one rank for every projection is served")
    (rank,) = ranks
    if not 0 < rank <= max_rank:
        raise AdapterError(f"the adapter at {path} has rank {rank}; this server takes ranks up to {max_rank}")
    alpha = float(field("adapter.lora.alpha") or 0)
    scale = alpha / rank if alpha else 1.0  # as llama.cpp scales
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"a", "b"} or ab["a"].ndim != 2 or ab["b"].ndim != 2 or ab["b"].shape[1] != rank:
            raise AdapterError(
                f"the adapter at {path} has no rank-{rank} lora_a and lora_b pair for layer {layer} {module}"
            )
        b = ab["b"]
        if permuted and module in ("q_proj", "k_proj"):
            b = _unpermute(b, heads[0] if module == "q_proj" else heads[1])
        weights[layer, module] = tuple(
            torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])) for w in (ab["a"], b)
        )
    return rank, scale, weights
