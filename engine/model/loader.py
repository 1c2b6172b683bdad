"""Load weights: the bundled GGUF, a Hugging Face checkpoint of a supported family, or dummy weights of a shape."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.core.config import DUMMY_SHAPES, ModelShape
from engine.model.decoder import RopeScaling
from engine.model.model_files import GGUFReader, ModelNotFoundError, check_model, default_model_path
from engine.model.quantized import QUANTIZED_TYPES, Blocks


class LazyWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors in float32, each read from the file (and dequantized) when asked for and not kept: a
    model loads one tensor at a time, never the whole float32 checkpoint beside its parameters, and not at all the
    layers that keep the file's blocks or that another pipeline stage holds."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]):
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


@dataclass
class Checkpoint:
    """A model's shape, its weights under Hugging Face Llama names, and its tokenizer (None for dummies)."""

    name: str
    shape: ModelShape
    weights: Mapping[str, torch.Tensor]
    tokenizer: object | None
    # A GGUF's quantized tensors as the file stores them (the types engine/model/quantized.py decodes), under the
    # same names as their float32 dequantizations in `weights`
    blocks: dict[str, Blocks] = field(default_factory=dict)


def load_checkpoint(model: str | None, seed: int = 0, weights: bool = True) -> Checkpoint:
    """`model` is a .gguf file, a Hugging Face checkpoint directory, `dummy:NAME`, or None for the default.

    weights=False reads only the shape and tokenizer (a pipeline driver holds no layers).
    """
    check_model(model)
    if model is None:
        return load_gguf(default_model_path(), weights)
    if model.startswith("dummy:"):
        return load_dummy(model.removeprefix("dummy:"), seed)
    if Path(model).is_dir():
        return load_hf_dir(Path(model), weights)
    return load_gguf(Path(model), weights)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Where an architecture's names differ: Phi-3's fused Q/K/V, and its fused gate/up under llama.cpp's `ffn_up`.
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_ARCH_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
}
# llama.cpp's Gemma: every n-th layer is global, the rest windowed.
_GGUF_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
# Tensors that are part of the shape, not weights.
_GGUF_SHAPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def load_gguf(path: Path, weights: bool = True) -> Checkpoint:
    from engine.model.tokenizer import tokenizer_from_gguf

    reader = GGUFReader(path, mode="c")  # copy-on-write: writable arrays (what torch takes) that stay the file's pages
    shape = shape_from_gguf(reader)
    ckpt = Checkpoint(path.name, shape, {}, tokenizer_from_gguf(reader))
    if weights:
        ckpt.weights, ckpt.blocks = gguf_weights(reader, shape)
    return ckpt


# GGUF architectures and what sets each apart; llama.cpp writes Mistral as "llama".
GGUF_FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "phi3": {"family": "phi3"},
    "gemma2": {"family": "gemma2"},
    "gemma3": {"family": "gemma3"},
}


def shape_from_gguf(reader) -> ModelShape:
    def field(key: str):
        return reader.fields[key].contents()

    arch = field("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: supported are {', '.join(sorted(GGUF_FAMILIES))}")
    num_heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors if t.name in _GGUF_SHAPE_TENSORS}

    def factors(name: str) -> tuple[float, ...] | None:
        return tuple(float(x) for x in np.asarray(tensors[name].data).reshape(-1)) if name in tensors else None

    # Llama 3.1's scaled RoPE: llama.cpp stores the per-frequency divisors as a tensor; Phi-3's LongRoPE two.
    extra = {}
    if "rope_factors_long.weight" in tensors:
        extra = {
            "rope_long_factors": factors("rope_factors_long.weight"),
            "rope_long_from": int(field(f"{arch}.rope.scaling.original_context_length")),
            "rope_attention_factor": float(field(f"{arch}.rope.scaling.attn_factor")),
        }
    window = (
        int(field(f"{arch}.attention.sliding_window")) if f"{arch}.attention.sliding_window" in reader.fields else 0
    )
    context = int(field(f"{arch}.context_length"))
    key_length = f"{arch}.attention.key_length"
    head_dim = int(field(key_length)) if key_length in reader.fields else hidden // num_heads
    freq_factors = factors("rope_freqs.weight") or factors("rope_factors_short.weight")
    if arch in _GGUF_WINDOW_PATTERN:
        extra = _gguf_gemma(reader, arch, hidden, num_heads, head_dim)
        freq_factors = extra.pop("rope_freq_factors", freq_factors)
    return ModelShape(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv")),
        head_dim=head_dim,
        rope_theta=float(field(f"{arch}.rope.freq_base")),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=context,
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        rope_freq_factors=freq_factors,
        sliding_window=window if 0 < window < context else None,
        **extra,
        **GGUF_FAMILIES[arch],
    )


def _gguf_gemma(reader, arch: str, hidden: int, num_heads: int, head_dim: int) -> dict:
    """Gemma's extras as llama.cpp reads them: the soft caps, its layer pattern, the windowed layers' RoPE base and
    the global ones' linear scaling (Gemma 3), and the softmax scale it derives from the model's size (1/sqrt(head_dim),
    but 1/sqrt(hidden / heads) for the 27B models: 46 layers of Gemma 2, 62 of Gemma 3)."""

    def get(key: str):
        return reader.fields[key].contents() if key in reader.fields else None

    layers, n = int(get(f"{arch}.block_count")), _GGUF_WINDOW_PATTERN[arch]
    out = {
        "sliding_layers": tuple(i % n < n - 1 for i in range(layers)),
        "attn_scale": (hidden / num_heads) ** -0.5 if layers in (46, 62) else head_dim**-0.5,
        "attn_logit_softcap": get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcap": get(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma3":
        out["rope_local_theta"] = 10000.0  # llama.cpp's, for every Gemma 3
        if get(f"{arch}.rope.scaling.type") == "linear":
            out["rope_freq_factors"] = (float(get(f"{arch}.rope.scaling.factor")),) * (head_dim // 2)
    return out


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two RoPE halves; restore rotate-half order.
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(reader, shape: ModelShape) -> tuple[LazyWeights, dict[str, Blocks]]:
    """Every tensor under its Hugging Face name, dequantized to float32 when read, and the quantized ones' blocks as
    stored."""
    readers, blocks = {}, {}
    # llama.cpp interleaves the RoPE halves of Llama's Q/K rows (not Qwen2's, which it rotates NeoX-style).
    arch = reader.fields["general.architecture"].contents()
    permuted = arch == "llama"
    names = _GGUF_NAMES | _GGUF_ARCH_NAMES.get(arch, {})
    for t in tqdm(reader.tensors, desc="reading", unit="tensor", leave=False):
        if t.name in _GGUF_SHAPE_TENSORS:
            continue  # part of the shape (rope_freq_factors and the like)
        heads, minus_one = None, False
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind, suffix = parts[2], parts[3]
            heads = {"attn_q": shape.num_heads, "attn_k": shape.num_kv_heads}.get(kind) if permuted else None
            name = f"model.layers.{parts[1]}.{names[kind]}.{suffix}"
            # llama.cpp stores Gemma's norms as 1 + w; the HF names hold w
            minus_one = arch in _GGUF_WINDOW_PATTERN and kind.endswith("norm")
        elif arch in _GGUF_WINDOW_PATTERN and parts[0] == "output_norm":
            name, minus_one = "model.norm.weight", True
        else:
            name = _GGUF_TOP_NAMES[parts[0]] + ".weight"
        readers[name] = functools.partial(_gguf_tensor, t, heads, minus_one)
        if int(t.tensor_type) in QUANTIZED_TYPES and len(t.shape) == 2:
            raw = t.data if heads is None else _unpermute(t.data, heads)  # the same permutation of whole rows
            # Not copied where contiguous: the blocks are the mapped file's pages (evictable, shared between engines)
            data = torch.from_numpy(np.ascontiguousarray(raw, np.uint8))
            blocks[name] = Blocks(int(t.tensor_type), data, int(t.shape[0]))
    return LazyWeights(readers), blocks


def _gguf_tensor(t, heads: int | None, minus_one: bool) -> torch.Tensor:
    """One GGUF tensor in float32 under Hugging Face's conventions (rotate-half Q/K rows, Gemma's norms as w)."""
    from gguf.quants import dequantize

    w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
    if heads is not None:
        w = _unpermute(w, heads)
    if minus_one:
        w = w - 1
    return torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


# ---------------------------------------------------------------- Hugging Face checkpoint directory


# What sets each supported family apart from Llama: declarative, in ModelShape's fields.
HF_FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "phi3": {"family": "phi3"},
    "gemma2": {"family": "gemma2"},
    "gemma3_text": {"family": "gemma3"},
}
# Families whose `sliding_window` applies unless `use_sliding_window` says otherwise (as transformers does).
WINDOWED_BY_DEFAULT = ("mistral", "phi3", "gemma2", "gemma3_text")


def _longrope(cfg: dict, rope: dict) -> dict:
    """Phi-3's LongRoPE as transformers computes it: the short divisors up to the pretrained context, the long ones
    from there on (transformers switches a whole sequence once it is longer; here each position picks its own, as
    keys cached before the switch keep theirs in transformers too), cos and sin scaled by sqrt(1 + ln(s) / ln(n))."""
    original = int(cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"])
    factor = cfg.get("max_position_embeddings", original) / original
    attention = rope.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    )
    return {
        "short": tuple(map(float, rope["short_factor"])),
        "rope_long_factors": tuple(map(float, rope["long_factor"])),
        "rope_long_from": original,
        "rope_attention_factor": float(attention),
    }


def shape_from_hf_config(cfg: dict) -> ModelShape:
    """A Hugging Face `config.json` of a supported family as a ModelShape; a clear error for anything else."""
    family = cfg.get("model_type", "llama")
    if family not in HF_FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}: supported are {', '.join(sorted(HF_FAMILIES))}")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    local = {}
    if "full_attention" in rope:  # RoPE per layer type (Gemma 3): the global layers' is the model's
        local, rope = rope.get("sliding_attention") or {}, rope["full_attention"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling, linear, longrope = None, None, {}
    if kind == "llama3":
        scaling = RopeScaling(
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    elif kind == "linear":  # every frequency divided by the factor (Gemma 3's global layers)
        linear = float(rope["factor"])
    elif kind == "longrope":
        longrope = _longrope(cfg, rope)
    elif kind != "default":
        raise ValueError(f"unsupported RoPE scaling {kind!r}: supported are default, linear, llama3 and longrope")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported RoPE scaling {local['rope_type']!r} on the windowed layers")
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("unsupported partial_rotary_factor: RoPE must rotate the whole head")
    short = longrope.pop("short", None)  # LongRoPE's short divisors are the model's divisors up to its switch
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    max_position = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    # Every layer sees its last `window` keys (Mistral v0.1; later ones set no window): the whole context is served,
    # and a request gives back the KV blocks before its window as it goes on (engine/core/scheduler.py).
    windowed = bool(window) and cfg.get("use_sliding_window", family in WINDOWED_BY_DEFAULT) and window < max_position
    return ModelShape(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=max_position,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_freq_factors=(
            scaling.freq_factors(head_dim, theta) if scaling else (linear,) * (head_dim // 2) if linear else short
        ),
        **longrope,
        rope_local_theta=float(local["rope_theta"]) if "rope_theta" in local else None,
        sliding_window=window if windowed else None,
        # which layers are windowed (Gemma alternates), where the config lists them
        sliding_layers=tuple(t == "sliding_attention" for t in cfg["layer_types"]) if cfg.get("layer_types") else None,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if cfg.get("query_pre_attn_scalar") else None,
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        **HF_FAMILIES[family],
    )


def load_hf_dir(path: Path, weights: bool = True) -> Checkpoint:
    from safetensors import safe_open

    from engine.model.tokenizer import load_tokenizer

    cfg = json.loads((path / "config.json").read_text())
    shape = shape_from_hf_config(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors in {path}")
    readers = {}
    for f in files if weights else []:
        handle = safe_open(f, framework="pt")  # the file mapped, each tensor read on request
        readers |= {k: functools.partial(_float32, handle, k) for k in handle.keys()}  # noqa: SIM118
    tokenizer = load_tokenizer(path)
    return Checkpoint(path.name, shape, LazyWeights(readers), tokenizer)


def _float32(handle, name: str) -> torch.Tensor:
    return handle.get_tensor(name).float()


# ---------------------------------------------------------------- dummy weights


def load_dummy(name: str, seed: int = 0) -> Checkpoint:
    """Random weights of a named shape: speed does not depend on weight values."""
    if name not in DUMMY_SHAPES:
        raise ModelNotFoundError(f"unknown dummy shape {name!r}; choose from {sorted(DUMMY_SHAPES)}")
    return Checkpoint(f"dummy:{name}", DUMMY_SHAPES[name], {}, _default_tokenizer_or_none())


def _default_tokenizer_or_none():
    # Benchmarks on a host without the default model still run; they send token ids.
    from engine.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except ModelNotFoundError:
        return None
