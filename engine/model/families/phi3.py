"""Phi-3: Llama's layer, with Q/K/V and gate/up stored fused in the checkpoint (and a sliding window where the
config sets one)."""

from __future__ import annotations

from engine.model.decoder import Source
from engine.model.families.llama import LlamaModel


class Phi3Model(LlamaModel):
    """Hugging Face Phi-3 checkpoints' names: `qkv_proj` and `gate_up_proj` are already one tensor each."""

    def layer_sources(self, i: int) -> dict[str, Source]:
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        return super().layer_sources(i) | {
            "qkv_proj.weight": Source((attn + "qkv_proj.weight",)),
            "gate_up_proj.weight": Source((mlp + "gate_up_proj.weight",)),
        }
