"""Gemma 2: GeGLU, a norm before and after both attention and the MLP, norms that scale by (1 + w), the embedding
scaled by sqrt(hidden), soft-capped attention scores and logits, and sliding-window layers alternating with global
ones (their scale and window carried by each layer's AttentionParams)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionParams
from engine.core.config import ModelShape
from engine.model.decoder import Source
from engine.model.families.llama import LlamaLayer, LlamaModel
from engine.model.sharding import TensorShard
from engine.model.token_ops import GeluAndMul, LogitSoftCap, RMSNorm


class Gemma2Layer(LlamaLayer):
    def __init__(self, shape: ModelShape, shard: TensorShard, index: int):
        super().__init__(shape, shard, index)
        self.attn_params = AttentionParams(
            shape.attn_scale or shape.head_dim**-0.5,
            shape.sliding_window if shape.is_sliding(index) else None,
            shape.attn_logit_softcap,
        )
        self.pre_feedforward_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.act = GeluAndMul()

    def post_attention(self, x, attn):
        """Attention's output normed before its residual add, the MLP's likewise."""
        a = self.post_attention_layernorm(self.shard.all_reduce(self.o_proj(attn.view(-1, self.q_size))))
        x, h = self.pre_feedforward_layernorm(a, x)
        return x + self.post_feedforward_layernorm(
            self.shard.all_reduce(self.down_proj(self.act(self.gate_up_proj(h))))
        )


class Gemma2Model(LlamaModel):
    """Hugging Face Gemma 2 checkpoints: Llama's names plus the two feed-forward norms."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cap = self.shape.final_logit_softcap
        # A module, so the CPU's fused version can replace it (token_ops.FUSED_CPU); none where there is no cap.
        self.logit_cap = LogitSoftCap(cap) if self.is_last and cap is not None else None

    def make_layer(self, shape: ModelShape, shard: TensorShard, index: int) -> Gemma2Layer:
        return Gemma2Layer(shape, shard, index)

    def layer_sources(self, i: int) -> dict[str, Source]:
        return super().layer_sources(i) | {
            f"{n}.weight": self.norm_source(f"layers.{i}.{n}.weight")
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        }

    def norm_source(self, name: str) -> Source:
        return Source((name,), _one_plus)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.shape.hidden_size**0.5, dtype=x.dtype)  # rounded to x's dtype, as Gemma does

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits(x)
        return logits if self.logit_cap is None else self.logit_cap(logits)


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    """Gemma's norms store w and scale by 1 + w (in float32)."""
    return 1.0 + w.float()
