"""The token-wise segments between attention calls, as the graph runners replay them: eager, or compiled by Inductor.

A forward pass over L layers is embed + pre[0] | attn | post[0] + pre[1] | attn | ... | post[L-1] + norm.
Each segment reads and writes the caller's buffers in place (the residual stream x, the queries q); the
pre-attention half also writes this iteration's K/V into the layer's cache. The layers are arguments, not
closures, so one compiled segment serves every layer.

Compiled (`torch.compile`, Inductor: Triton kernels on a GPU, C++ on the CPU), a segment's residual add and
RMSNorm, SiLU-and-multiply, and RoPE with the K/V write each become one fused kernel between the GEMMs,
and the copies into the static buffers fold into them. The token count is one symbolic (unbacked) size,
so one compile serves every graph bucket; Inductor's on-disk cache makes a second start fast.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.decoder import Decoder, DecoderLayer

log = logging.getLogger(__name__)


def enter(
    model: Decoder,
    layer: DecoderLayer,
    ids: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor,
) -> None:
    """The embedding, then the first layer's pre-attention half: x <- embed(ids), q <- its queries."""
    x.copy_(model.embed(ids))
    q.copy_(layer.pre_attention(x, positions, kv_cache, slot_mapping))


def between(
    prev: DecoderLayer,
    layer: DecoderLayer,
    x: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q: torch.Tensor,
) -> None:
    """prev's post-attention half, then layer's pre-attention half (its residual add and norm fuse with it)."""
    x.copy_(prev.post_attention(x, attn))
    q.copy_(layer.pre_attention(x, positions, kv_cache, slot_mapping))


def leave(model: Decoder, layer: DecoderLayer, x: torch.Tensor, attn: torch.Tensor) -> None:
    """The last layer's post-attention half and the final norm: x <- what the LM head reads."""
    x.copy_(model.final_norm(layer.post_attention(x, attn)))


@dataclass(frozen=True)
class Segments:
    """The three segment functions a graph runner calls: these, or the same code compiled."""

    enter: Callable[..., None] = enter
    between: Callable[..., None] = between
    leave: Callable[..., None] = leave


EAGER = Segments()
TOKEN_ARGS = frozenset({"ids", "positions", "slot_mapping", "x", "q", "attn"})  # the arguments whose dim 0 is T


class Compiled:
    """A segment through torch.compile. Its token arguments go in as tensors of their own with dim 0 unbacked: a
    view would make Dynamo guard on its base's size, and a backed size would specialise buckets 1 and 2+ apart."""

    def __init__(self, fn: Callable[..., None], backend):
        self.signature = inspect.signature(fn)
        self.fn = torch.compile(_same_token_count(fn, self.signature), backend=backend, fullgraph=True, dynamic=False)

    def __call__(self, *args) -> None:
        bound = self.signature.bind(*args)
        for name in TOKEN_ARGS & bound.arguments.keys():
            bound.arguments[name] = _unbacked(bound.arguments[name])
        self.fn(*bound.args)


def _same_token_count(fn: Callable[..., None], signature: inspect.Signature) -> Callable[..., None]:
    """fn, first telling the compiler that its token arguments share one dim 0: each is marked unbacked on its own
    (u0, u1...), and without this `x.copy_(embed(ids))` must guard on u0 == u1, which torch 2.11 refuses."""
    where = [i for i, name in enumerate(signature.parameters) if name in TOKEN_ARGS]

    def checked(*args):
        n = args[where[0]].shape[0]
        for i in where[1:]:
            torch._check(args[i].shape[0] == n)
        fn(*args)

    return checked


def _unbacked(t: torch.Tensor) -> torch.Tensor:
    """t's memory as a tensor that is not a view, its dim 0 marked unbacked (symbolic, no 0/1 specialisation)."""
    own = torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )
    torch._dynamo.decorators.mark_unbacked(own, 0)
    return own


def compile_segments(model: Decoder, kv_cache: torch.Tensor, scratch_slot: int, backend="inductor") -> Segments:
    """The compiled segments, each run once on two tokens whose K/V go to `scratch_slot` (compiling happens there,
    before any capture: a compiler must not run, nor Triton autotune, inside a CUDA graph capture)."""
    segments = Segments(*(Compiled(f, backend) for f in (enter, between, leave)))
    layers, s, device = model.layers, model.shape, kv_cache.device
    x = torch.zeros(2, s.hidden_size, dtype=kv_cache.dtype, device=device)
    q, attn = (torch.zeros(2, s.num_heads, s.head_dim, dtype=kv_cache.dtype, device=device) for _ in range(2))
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    slots = torch.full((2,), scratch_slot, dtype=torch.int64, device=device)
    start = time.perf_counter()
    with torch.inference_mode():  # as the captures run: grad mode is part of what Dynamo guards on
        segments.enter(model, layers[0], ids, ids, kv_cache, slots, x, q)
        if len(layers) > 1:
            segments.between(layers[0], layers[1], x, attn, ids, kv_cache, slots, q)
        segments.leave(model, layers[-1], x, attn)
    log.info("compiled the token-wise segments (torch.compile, Inductor) in %.1f s", time.perf_counter() - start)
    return segments


def pick_segments(
    mode: str, use_graphs: bool, model: Decoder, kv_caches: list[torch.Tensor], scratch_block: int, backend="inductor"
) -> Segments:
    """EngineConfig.compile: "auto" compiles where graphs run and falls back to eager ops (with a warning) if
    compiling fails, so the server still starts; "on" raises instead, and where no graphs run; "off" never compiles."""
    if not use_graphs:
        if mode == "on":
            raise ValueError(
                "compile=on: the compiled segments run inside the CUDA graphs, which run only for a "
                "whole model on one GPU without --enforce-eager"
            )
        return EAGER
    if mode == "off":
        return EAGER
    try:
        return compile_segments(model, kv_caches[0], scratch_block * kv_caches[0].shape[3], backend)
    except Exception as e:  # Dynamo, Inductor, a C++ or Triton compiler: any of them is a reason to run eager
        if mode == "on":
            raise
        warnings.warn(f"torch.compile of the token-wise segments failed, running them eagerly: {e!r}", stacklevel=2)
        return EAGER
