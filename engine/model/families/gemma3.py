"""Gemma 3 (text): Gemma 2's layer with its queries and keys RMS-normed per head before RoPE, no attention soft cap,
and the windowed layers (five in six) on a RoPE base of their own."""

from __future__ import annotations

from engine.core.config import ModelShape
from engine.model.decoder import Source
from engine.model.families.gemma2 import Gemma2Layer, Gemma2Model
from engine.model.sharding import TensorShard
from engine.model.token_ops import HeadRMSNorm


class Gemma3Layer(Gemma2Layer):
    def __init__(self, shape: ModelShape, shard: TensorShard, index: int):
        super().__init__(shape, shard, index)
        self.q_norm = HeadRMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = HeadRMSNorm(shape.head_dim, shape.rms_norm_eps)

    def pre_attention(self, x, positions, kv_cache, slot_mapping):
        """Norm, fused QKV, each query and key head normed, then RoPE and the K/V write."""
        return self.rotary.norm_rope_write_kv(
            self.qkv_proj(self.input_layernorm(x)),
            self.q_norm,
            self.k_norm,
            positions,
            kv_cache,
            slot_mapping,
            self.shape.num_heads,
            self.shape.num_kv_heads,
        )


class Gemma3Model(Gemma2Model):
    """Hugging Face Gemma 3 text checkpoints: Gemma 2's names plus each layer's q_norm and k_norm."""

    def make_layer(self, shape: ModelShape, shard: TensorShard, index: int) -> Gemma3Layer:
        return Gemma3Layer(shape, shard, index)

    def layer_sources(self, i: int) -> dict[str, Source]:
        return super().layer_sources(i) | {
            f"{n}.weight": self.norm_source(f"layers.{i}.self_attn.{n}.weight") for n in ("q_norm", "k_norm")
        }

    def rope(self, index: int) -> tuple[float, tuple[float, ...] | None]:
        if self.shape.is_sliding(index) and self.shape.rope_local_theta is not None:
            return self.shape.rope_local_theta, None
        return super().rope(index)
