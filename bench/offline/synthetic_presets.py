"""The shapes of today's small models as their GGUF files hold them, and the tensor types llama.cpp's quantizer gives
each tensor of a Q4_K_M file (src/llama-quant.cpp: llama_tensor_get_type_impl and its fallback for widths that are
not whole 256-weight blocks)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Preset:
    """One architecture's metadata under its own `{arch}.` keys, plus what the tensors need."""

    arch: str
    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    rms_eps: float
    tied: bool = True
    qkv_bias: bool = False
    # Llama 3's RoPE scaling (factor, low_freq_factor, high_freq_factor, original context): a rope_freqs tensor.
    llama3_rope: tuple[float, float, float, int] | None = None
    extra: dict = field(default_factory=dict)  # further `{arch}.` keys the real file has

    @property
    def gemma(self) -> bool:
        return self.arch.startswith("gemma")

    def keys(self, layers: int) -> dict:
        """The `{arch}.*` key-value pairs of a file of `layers` blocks."""
        keys = {
            "context_length": self.context,
            "embedding_length": self.hidden,
            "block_count": layers,
            "feed_forward_length": self.ffn,
            "attention.head_count": self.heads,
            "attention.head_count_kv": self.kv_heads,
            "attention.key_length": self.head_dim,
            "attention.value_length": self.head_dim,
            "attention.layer_norm_rms_epsilon": self.rms_eps,
            "rope.freq_base": self.rope_theta,
        }
        if self.arch == "llama":
            keys |= {"vocab_size": self.vocab, "rope.dimension_count": self.head_dim}
        return {f"{self.arch}.{k}": v for k, v in (keys | self.extra).items()}


PRESETS: dict[str, Preset] = {
    # google/gemma-3-270m: 262k vocabulary, tied, 4 query heads on 1 KV head of 256, windowed layers (5 in 6) of 512
    "gemma3-270m": Preset(
        "gemma3", 262144, 640, 18, 2048, 4, 1, 256, 32768, 1_000_000.0, 1e-6, extra={"attention.sliding_window": 512}
    ),
    # meta-llama/Llama-3.2-1B: 128k vocabulary, tied, Llama 3's scaled RoPE
    "llama3.2-1b": Preset(
        "llama", 128256, 2048, 16, 8192, 32, 8, 64, 131072, 500_000.0, 1e-5, llama3_rope=(32.0, 1.0, 4.0, 8192)
    ),
    # Qwen/Qwen2.5-0.5B: 152k vocabulary, tied, Q/K/V biases
    "qwen2.5-0.5b": Preset("qwen2", 151936, 896, 24, 4864, 14, 2, 64, 32768, 1_000_000.0, 1e-6, qkv_bias=True),
}

# What the quantizer falls back to where a row is not whole 256-weight blocks.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(kind: str, layer: int, layers: int, cols: int, tied: bool) -> Q:
    """The type of tensor `kind` (llama.cpp's name: attn_v, ffn_down, token_embd, ...) of a row of `cols` weights."""
    if kind == "output" or (kind == "token_embd" and tied):
        return Q.Q6_K if cols % 256 == 0 else Q.Q8_0
    kind_type = Q.Q6_K if kind in ("attn_v", "ffn_down") and _more_bits(layer, layers) else Q.Q4_K
    return kind_type if cols % 256 == 0 else _FALLBACK[kind_type]


def llama3_rope_factors(p: Preset) -> list[float]:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for Llama 3's scaled RoPE."""
    factor, low, high, original = p.llama3_rope
    out = []
    for i in range(0, p.head_dim, 2):
        wavelen = 2 * math.pi * p.rope_theta ** (i / p.head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
