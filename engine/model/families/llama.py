"""Llama and the families that are Llama with a twist of its shape: Llama 2/3.x, Mistral (a sliding window),
Qwen2 (Q/K/V biases), SmolLM2. Their differences are ModelShape fields, not copies of this file."""

from __future__ import annotations

from torch import nn

from engine.attention.backend import AttentionParams
from engine.core.config import ModelShape
from engine.model.decoder import Decoder, Source
from engine.model.sharding import TensorShard
from engine.model.token_ops import RMSNorm, SiluAndMul


class LlamaLayer(nn.Module):
    """One block of this rank's heads and MLP width (`shape` is the local shape; the shard sums the partial outputs)."""

    def __init__(self, shape: ModelShape, shard: TensorShard, index: int):
        super().__init__()
        self.shape = shape
        self.shard = shard
        h, d = shape.hidden_size, shape.head_dim
        self.q_size, self.kv_size = shape.num_heads * d, shape.num_kv_heads * d
        self.attn_params = AttentionParams(d**-0.5, shape.sliding_window if shape.is_sliding(index) else None)
        self.input_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, shape.rms_norm_eps)
        # Q, K, V (and gate, up) fused: one matmul instead of three on the flattened batch.
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * shape.intermediate_size, bias=False)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)
        self.rotary = None  # the model's RoPE table for this layer, set by Decoder.materialize_buffers

    # The two token-wise halves on either side of attention: the pieces CUDA graphs capture and Inductor fuses.

    def pre_attention(self, x, positions, kv_cache, slot_mapping):
        """Norm, fused QKV, RoPE, and this iteration's K/V into the cache: [T, hidden] -> q [T, Hq, D]."""
        qkv = self.qkv_proj(self.input_layernorm(x))
        return self.rotary.rope_write_kv(
            qkv, positions, kv_cache, slot_mapping, self.shape.num_heads, self.shape.num_kv_heads
        )

    def post_attention(self, x, attn):
        """Output projection and MLP, each with its residual: ([T, hidden], [T, Hq, D]) -> [T, hidden]."""
        x, h = self.post_attention_layernorm(self.shard.all_reduce(self.o_proj(attn.view(-1, self.q_size))), x)
        return x + self.shard.all_reduce(self.down_proj(self.act(self.gate_up_proj(h))))


class LlamaModel(Decoder):
    """Hugging Face Llama checkpoints' names; Q/K/V and gate/up fused at load."""

    def make_layer(self, shape: ModelShape, shard: TensorShard, index: int) -> LlamaLayer:
        return LlamaLayer(shape, shard, index)

    def layer_sources(self, i: int) -> dict[str, Source]:
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out = {
            "input_layernorm.weight": self.norm_source(f"layers.{i}.input_layernorm.weight"),
            "post_attention_layernorm.weight": self.norm_source(f"layers.{i}.post_attention_layernorm.weight"),
            "qkv_proj.weight": Source(tuple(f"{attn}{n}_proj.weight" for n in "qkv")),
            "o_proj.weight": Source((attn + "o_proj.weight",)),
            "gate_up_proj.weight": Source((mlp + "gate_proj.weight", mlp + "up_proj.weight")),
            "down_proj.weight": Source((mlp + "down_proj.weight",)),
        }
        if self.shape.qkv_bias:
            out["qkv_proj.bias"] = Source(tuple(f"{attn}{n}_proj.bias" for n in "qkv"))
        return out
