"""Llama-family decoder over a flattened token batch (selective batching: no padding, attention split per request).

Llama 2/3.x, Mistral and Qwen2 share it; their differences are fields of ModelShape (Q/K/V biases,
scaled RoPE frequencies), not copies of this file."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams, write_kv
from engine.core.config import ModelShape
from engine.model.sharding import TensorShard
from engine.model.token_ops import RMSNorm, SiluAndMul


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (the GGUF loader undoes llama.cpp's Q/K row permutation)."""

    def __init__(self, head_dim: int, theta: float, max_position: int, freq_factors: tuple[float, ...] | None = None):
        super().__init__()
        inv_freq = base_frequencies(head_dim, theta)
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # [positions, 2, D]: cos for both halves, then -sin and sin, so a call is one gather and
        # x * cos + swap_halves(x) * sin (5 kernels; 9 with the halves apart). build_model casts it to the
        # compute dtype once: the same values a cast per call gave.
        table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (queries and keys together) rotated by each row's position."""
        cos, sin = self.table[positions].to(x.dtype).unsqueeze(2).unbind(1)  # [T, 1, D] each
        return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin  # the halves swapped: no cat


def base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling: long wavelengths slowed by `factor`, short ones kept, a ramp between."""

    factor: float = 8.0  # how much the long wavelengths are stretched
    low_freq_factor: float = 1.0  # wavelengths above original_max_position / this are scaled fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_position / this are not scaled
    original_max_position: int = 8192  # the context the base frequencies were trained for

    def freq_factors(self, head_dim: int, theta: float) -> tuple[float, ...]:
        """Each frequency's divisor, as llama.cpp stores the scaling (transformers' `llama3` rope type)."""
        inv_freq = base_frequencies(head_dim, theta)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return tuple((inv_freq / torch.where(medium, smoothed, scaled)).tolist())


class DecoderLayer(nn.Module):
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

    def forward(self, x, positions, rotary, kv_cache, meta, attention: AttentionBackend):
        q = self.pre_attention(x, positions, rotary, kv_cache, meta.slot_mapping)
        return self.post_attention(x, attention.forward(q, kv_cache, meta, self.attn_params))

    # The two token-wise halves on either side of attention: the pieces CUDA graphs capture and Inductor fuses.

    def pre_attention(self, x, positions, rotary, kv_cache, slot_mapping):
        """Norm, fused QKV, RoPE, and this iteration's K/V into the cache: [T, hidden] -> q [T, Hq, D]."""
        s = self.shape
        qkv = self.qkv_proj(self.input_layernorm(x))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys rotate in one call: half the small ops of a decode step's RoPE. Views of the QKV
        # output throughout: the write reads k and v where they are, and q goes to attention strided.
        q, k = rotary(qk.view(-1, s.num_heads + s.num_kv_heads, s.head_dim), positions).split(
            [s.num_heads, s.num_kv_heads], dim=1)
        write_kv(k, v.view(-1, s.num_kv_heads, s.head_dim), kv_cache, slot_mapping)
        return q

    def post_attention(self, x, attn):
        """Output projection and MLP, each with its residual: ([T, hidden], [T, Hq, D]) -> [T, hidden]."""
        x, h = self.post_attention_layernorm(self.shard.all_reduce(self.o_proj(attn.view(-1, self.q_size))), x)
        return x + self.shard.all_reduce(self.down_proj(self.act(self.gate_up_proj(h))))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; logits only for the rows asked for.

    A pipeline stage holds a contiguous span of the layers: the embedding comes with the first
    span, the final norm and LM head with the last. A whole model is the one span of all layers.
    Under tensor parallelism a rank holds its shard of each (engine/model/sharding.py): `shape` is then
    the local one (its heads, its MLP width), `full_shape` the whole model's.
    """

    def __init__(self, shape: ModelShape, max_position: int, layer_span: range | None = None,
                 shard: TensorShard = TensorShard()):
        super().__init__()
        self.full_shape = shape
        self.shard = shard
        self.shape = shape = shard.local_shape(shape)
        self.layer_span = layer_span if layer_span is not None else range(shape.num_layers)
        self.is_first = self.layer_span.start == 0
        self.is_last = self.layer_span.stop == shape.num_layers
        start, end = shard.vocab_range(shape.vocab_size)
        if self.is_first:
            self.embed_tokens = nn.Embedding(end - start, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, shard, i) for i in self.layer_span)
        if self.is_last:
            self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = nn.Linear(shape.hidden_size, end - start, bias=False)
        self.max_position = max_position
        self.materialize_buffers()

    @property
    def is_whole(self) -> bool:
        return self.is_first and self.is_last

    def materialize_buffers(self) -> None:
        """(Re)build what is computed rather than loaded, on the parameters' device; re-tie the LM head."""
        shape = self.shape
        with next(self.parameters()).device:
            self.rotary = Rotary(shape.head_dim, shape.rope_theta, self.max_position, shape.rope_freq_factors)
        if shape.tie_word_embeddings and self.is_whole:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]; unused by a stage after the first
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer of this span
        meta: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor,  # rows whose next token is sampled
        hidden: torch.Tensor | None = None,  # [T, hidden] from the previous stage
    ) -> torch.Tensor:
        """Logits [num_sampled, vocab] from the last span; the hidden states [T, hidden] from any other."""
        x = self.shard.embed(self.embed_tokens.weight, input_ids) if self.is_first else hidden
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv_cache, meta, attention)
        if not self.is_last:
            return x
        return self.shard.gather_vocab(self.lm_head(self.norm(x[logits_indices])), self.shape.vocab_size).float()

    def _source_name(self, name: str) -> str:
        """This span's parameter name -> the whole model's (Hugging Face, without `model.`)."""
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            return f"layers.{self.layer_span.start + int(i)}.{rest}"
        if name == "lm_head.weight" and self.shape.tie_word_embeddings:
            return "embed_tokens.weight"
        return name

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face Llama names (`model.layers.N.self_attn.q_proj.weight`, ...) and fuse Q/K/V, gate/up."""
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        params = dict(self.named_parameters(remove_duplicate=False))  # a tied LM head is filled twice, harmlessly

        def put(name: str, full: torch.Tensor) -> None:  # this rank's slice of the whole model's tensor
            params[name].copy_(self.shard.take(name, full, self.full_shape))

        if self.is_first:
            put("embed_tokens.weight", w["embed_tokens.weight"])
        if self.is_last:
            put("norm.weight", w["norm.weight"])
            put("lm_head.weight", w[self._source_name("lm_head.weight")])
        for local, (i, layer) in enumerate(zip(self.layer_span, self.layers)):
            p, mine = f"layers.{i}.", f"layers.{local}."
            attn, mlp = p + "self_attn.", p + "mlp."
            put(mine + "input_layernorm.weight", w[p + "input_layernorm.weight"])
            put(mine + "post_attention_layernorm.weight", w[p + "post_attention_layernorm.weight"])
            put(mine + "qkv_proj.weight", torch.cat([w[attn + n + "_proj.weight"] for n in "qkv"]))
            if layer.qkv_proj.bias is not None:
                put(mine + "qkv_proj.bias", torch.cat([w[attn + n + "_proj.bias"] for n in "qkv"]))
            put(mine + "o_proj.weight", w[attn + "o_proj.weight"])
            put(mine + "gate_up_proj.weight", torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]))
            put(mine + "down_proj.weight", w[mlp + "down_proj.weight"])

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Dummy weights for benchmarks: N(0, 0.02) matrices, unit norms.

        Each parameter draws from its own stream, seeded by its whole-model name, so every pipeline
        split of a dummy model holds the same weights; a tensor-parallel rank draws the whole tensor and
        keeps its slice.
        """
        device = next(self.parameters()).device
        with torch.device("meta"):
            whole = dict(LlamaModel(self.full_shape, 1, self.layer_span).named_parameters())
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            source = self._source_name(name)
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(source.encode()))
            full = torch.empty(whole[name].shape, device=device).normal_(0.0, 0.02, generator=gen)
            p.copy_(self.shard.take(name, full, self.full_shape))
