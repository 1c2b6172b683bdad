"""The model interface: a decoder of layers over a flattened token batch, each layer two token-wise halves around
attention. The runner, both graph runners, tensor sharding and pipeline stages know a model only through it.

A family (engine/model/families/) subclasses `Decoder`: it makes its layers, says how its checkpoint's tensors
become its parameters, and may change the embedding, the final norm or the logits. The glue (embed -> layers ->
norm -> head, and where a pipeline stage's span or a tensor-parallel shard cuts it) is written here once.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from engine.core.config import ModelShape
from engine.model.sharding import WHOLE, TensorShard
from engine.model.token_ops import RMSNorm, Rotary, base_frequencies


class DecoderLayer(Protocol):
    """One block: its attention's parameters and the two token-wise halves the graph runners capture."""

    attn_params: AttentionParams

    def pre_attention(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """[T, hidden] -> queries [T, Hq, D]; this iteration's K/V go into the layer's cache at slot_mapping."""
        ...

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream x and the attention output [T, Hq, D] -> the next layer's input [T, hidden]."""
        ...


# How a parameter is made from checkpoint tensors (Hugging Face names without `model.`): the named tensors
# concatenated along dim 0, then `transform` (Gemma's norms store w for a (1 + w) scale, say).
@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm and LM head; logits only for the rows asked for.

    A pipeline stage holds a contiguous span of the layers: the embedding comes with the first span, the final
    norm and LM head with the last. A whole model is the one span of all layers. Under tensor parallelism a rank
    holds its shard of each (engine/model/sharding.py): `shape` is then the local one (its heads, its MLP width),
    `full_shape` the whole model's.
    """

    def __init__(
        self, shape: ModelShape, max_position: int, layer_span: range | None = None, shard: TensorShard = WHOLE
    ):
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
        self.layers = nn.ModuleList(self.make_layer(shape, shard, i) for i in self.layer_span)
        if self.is_last:
            self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = nn.Linear(shape.hidden_size, end - start, bias=False)
        self.max_position = max_position
        if next(self.parameters()).device.type != "meta":  # on meta, the caller materializes after to_empty
            self.materialize_buffers()

    # ------------------------------------------------------------------ what a family says

    def make_layer(self, shape: ModelShape, shard: TensorShard, index: int) -> nn.Module:
        """Layer `index` of the whole model, of this rank's local shape."""
        raise NotImplementedError

    def layer_sources(self, i: int) -> dict[str, Source]:
        """Layer i's parameters (names within the layer) and the checkpoint tensors each is made from."""
        raise NotImplementedError

    def rope(self, index: int) -> tuple[float, tuple[float, ...] | None]:
        """Layer `index`'s RoPE base and frequency divisors (one table is built per distinct pair)."""
        return self.shape.rope_theta, self.shape.rope_freq_factors

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]: this rank's rows of the embedding, summed over ranks."""
        return self.shard.embed(self.embed_tokens.weight, input_ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normed rows [N, hidden] -> float32 logits [N, vocab] (gathered over tensor-parallel ranks)."""
        return self.shard.gather_vocab(self.lm_head(x), self.shape.vocab_size).float()

    # ------------------------------------------------------------------ the glue, once

    @property
    def is_whole(self) -> bool:
        return self.is_first and self.is_last

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]; unused by a stage after the first
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer of this span
        meta: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None,  # rows whose next token is sampled
        hidden: torch.Tensor | None = None,  # [T, hidden] from the previous stage
    ) -> torch.Tensor:
        """Logits [num_sampled, vocab] from the last span; the hidden states [T, hidden] from any other. With
        logits_indices None the last span returns every row final-normed [T, hidden], for a caller that takes the
        logits of more rows than it samples (prompt logprobs) a few at a time."""
        x = self.embed(input_ids) if self.is_first else hidden
        for layer, kv_cache in zip(self.layers, kv_caches):
            q = layer.pre_attention(x, positions, kv_cache, meta.slot_mapping)
            x = layer.post_attention(x, attention.forward(q, kv_cache, meta, layer.attn_params))
        if not self.is_last:
            return x
        if logits_indices is None:
            return self.final_norm(x)
        return self.logits(self.final_norm(x[logits_indices]))

    def materialize_buffers(self) -> None:
        """(Re)build what is computed rather than loaded, on the parameters' device; re-tie the LM head."""
        tables: dict[tuple, Rotary] = {}
        with next(self.parameters()).device:
            for i, layer in zip(self.layer_span, self.layers):
                theta, factors = self.rope(i)
                if (theta, factors) not in tables:
                    long = (
                        None
                        if self.shape.rope_long_factors is None
                        else (self.shape.rope_long_factors, self.shape.rope_long_from, self.shape.rope_attention_factor)
                    )
                    tables[theta, factors] = Rotary(self.shape.head_dim, theta, self.max_position, factors, long)
                layer.rotary = tables[theta, factors]  # shared: layers of one kind read one table
        if self.shape.tie_word_embeddings and self.is_whole:
            self.lm_head.weight = self.embed_tokens.weight

    def sources(self) -> dict[str, Source]:
        """Every parameter of this span and shard (names as named_parameters gives them) and its source."""
        out = {}
        if self.is_first:
            out["embed_tokens.weight"] = Source(("embed_tokens.weight",))
        if self.is_last:
            out["norm.weight"] = self.norm_source("norm.weight")
            head = "embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
            out["lm_head.weight"] = Source((head,))
        for local, i in enumerate(self.layer_span):
            out |= {f"layers.{local}.{k}": v for k, v in self.layer_sources(i).items()}
        return out

    def _global(self, name: str) -> str:
        """This span's parameter name -> the whole model's (a tied LM head is the embedding)."""
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            return f"layers.{self.layer_span.start + int(i)}.{rest}"
        if name == "lm_head.weight" and self.shape.tie_word_embeddings:
            return "embed_tokens.weight"
        return name

    def norm_source(self, name: str) -> Source:
        """A norm weight's source: the tensor itself (a family whose norms scale by 1 + w says otherwise)."""
        return Source((name,))

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], skip: set[str] = frozenset()) -> None:
        """Each parameter but those in `skip` from its checkpoint tensors (Hugging Face names; `model.` prefixes
        dropped), each read from `weights` only when needed."""
        prefixed = {k.removeprefix("model."): k for k in weights}
        params = dict(self.named_parameters(remove_duplicate=False))  # a tied LM head is filled twice, harmlessly
        for name, source in self.sources().items():
            if name in skip:
                continue
            tensors = [weights[prefixed[n]] for n in source.names]
            full = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            if source.transform is not None:
                full = source.transform(full)
            params[name].copy_(self.shard.take(name, full, self.full_shape))

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Dummy weights for benchmarks: N(0, 0.02) matrices, unit norms.

        Each parameter draws from its own stream, seeded by its whole-model name, so every pipeline split of a dummy
        model holds the same weights; a tensor-parallel rank draws the whole tensor and keeps its slice.
        """
        device = next(self.parameters()).device
        with torch.device("meta"), SkippedInit():
            whole = dict(type(self)(self.full_shape, 1, self.layer_span).named_parameters())
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(self._global(name).encode()))
            full = torch.empty(whole[name].shape, device=device).normal_(0.0, 0.02, generator=gen)
            p.copy_(self.shard.take(name, full, self.full_shape))


class SkippedInit(torch.overrides.TorchFunctionMode):
    """Modules built inside skip torch.nn.init's random draws, for parameters that are overwritten next. On the meta
    device those draws run as Python decompositions whose first call imports torch._dynamo, slowing every start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------- RoPE scaling, shared by the families


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
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return tuple((inv_freq / torch.where(medium, smoothed, scaled)).tolist())
