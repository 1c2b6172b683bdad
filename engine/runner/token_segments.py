"""The token-wise segments between attention calls, as the graph runners replay them.

A forward pass over L layers is embed + pre[0] | attn | post[0] + pre[1] | attn | ... | post[L-1] + norm.
Each segment reads and writes the caller's buffers in place (the residual stream x, the queries q); the
pre-attention half also writes this iteration's K/V into the layer's cache. The layers are arguments, not
closures, so one compiled segment can serve every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engine.model.llama import DecoderLayer, Rotary


def enter(embed: nn.Embedding, layer: DecoderLayer, rotary: Rotary, ids: torch.Tensor, positions: torch.Tensor,
          kv_cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> None:
    """The embedding, then the first layer's pre-attention half: x <- embed(ids), q <- its queries."""
    x.copy_(embed(ids))
    q.copy_(layer.pre_attention(x, positions, rotary, kv_cache, slot_mapping))


def between(prev: DecoderLayer, layer: DecoderLayer, rotary: Rotary, x: torch.Tensor, attn: torch.Tensor,
            positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, q: torch.Tensor) -> None:
    """prev's post-attention half, then layer's pre-attention half (its residual add and norm fuse with it)."""
    x.copy_(prev.post_attention(x, attn))
    q.copy_(layer.pre_attention(x, positions, rotary, kv_cache, slot_mapping))


def leave(layer: DecoderLayer, norm: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> None:
    """The last layer's post-attention half and the final norm: x <- what the LM head reads."""
    x.copy_(norm(layer.post_attention(x, attn)))


@dataclass(frozen=True)
class Segments:
    """The three segment functions a graph runner calls."""

    enter: Callable[..., None] = enter
    between: Callable[..., None] = between
    leave: Callable[..., None] = leave


EAGER = Segments()
