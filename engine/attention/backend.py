"""Ragged attention over the paged KV cache, behind a backend interface.

Selective batching: every token-wise op runs on the flattened `[T, hidden]` batch; only
attention is split per request, driven by this metadata. A KV cache layer is one tensor
`[2, num_kv_heads, num_blocks, block_size, head_dim]` (keys, then values; head-major so that
a gathered context is already `[heads, tokens, head_dim]` for matmul); token `t` of a request
lives in slot `block_table[t // block_size] * block_size + t % block_size`. The cache is of the queries' dtype, or
bfloat16 / float16 under float32 queries (--kv-cache-dtype): a backend reads it widened to the queries' dtype.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

# A request with at most this many queries (a decode step, or one verifying draft tokens) attends as that many
# decode queries, each against the keys up to its own position: a paged decode op reads them in place, where a chunk's
# SDPA would first gather its whole context.
MAX_DECODE_LIKE_QUERIES = 32


@dataclass(frozen=True)
class DecodeRows:
    """The queries of requests with few of them, each as one decode query: its row, its request, its keys."""

    token_rows: torch.Tensor | None  # [R] rows of the flattened batch; None: every row, in order
    requests: torch.Tensor  # [R] int32: each row's request (its block table); a request's rows are neighbours
    context_lens: torch.Tensor  # [R] int32: keys each row sees, its own included
    max_context_len: int


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flattened batch and where its keys live."""

    query_start_loc: torch.Tensor  # [B + 1] int32: request i's queries are rows [qsl[i], qsl[i+1])
    context_lens: torch.Tensor  # [B] int32: tokens in cache once this iteration's K/V are written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    query_lens_cpu: list[int]  # host copies, so backends need no device sync to loop
    context_lens_cpu: list[int]
    # [tiles, 4] int32 (engine/attention/prompt_tiles.py): a whole-step graph's prompt rows, which a backend that
    # tiles them attends by tile; their context_lens are negative. None: no tiles, every row a decode query.
    prompt_tiles: torch.Tensor | None = None
    _decode_rows: dict = field(default_factory=dict, repr=False, compare=False)  # decode_rows' answers by limit

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)

    # Asked by every layer's attention of a step, and computed once: at batch 1 a step's Python is a fifth of it.
    @functools.cached_property
    def is_pure_decode(self) -> bool:
        """One query per request: row i of the batch is request i."""
        return all(n == 1 for n in self.query_lens_cpu)

    def decode_rows(self, context_limit: int = 0) -> DecodeRows | None:
        """Queries of requests with at most MAX_DECODE_LIKE_QUERIES of them, or at most `context_limit` keys, as
        decode queries; None if there are none. Computed once a step per limit: every layer asks."""
        cached = self._decode_rows.get(context_limit, False)
        if cached is not False:
            return cached
        rows, requests, lens = [], [], []
        start = 0
        for i, (n, ctx) in enumerate(zip(self.query_lens_cpu, self.context_lens_cpu)):
            if n <= MAX_DECODE_LIKE_QUERIES or ctx <= context_limit:  # query j sits at position ctx - n + j
                rows += range(start, start + n)
                requests += [i] * n
                lens += range(ctx - n + 1, ctx + 1)
            start += n
        d = None
        if rows:
            device = self.query_start_loc.device
            every = len(rows) == start
            d = DecodeRows(
                None if every else torch.tensor(rows, device=device),
                torch.tensor(requests, dtype=torch.int32, device=device),
                torch.tensor(lens, dtype=torch.int32, device=device),
                max(lens),
            )
        self._decode_rows[context_limit] = d
        return d

    @functools.cached_property
    def max_context_len(self) -> int:
        return max(self.context_lens_cpu, default=0)

    @functools.cached_property
    def max_decode_context_len(self) -> int:
        """The longest context of a request with one query (0 if none): a decode kernel's split plan reads it."""
        return max((c for n, c in zip(self.query_lens_cpu, self.context_lens_cpu) if n == 1), default=0)

    @property
    def query_starts_cpu(self) -> list[int]:
        """query_start_loc on the host (B + 1 offsets), from the host lengths: reading the tensor would sync."""
        return [0, *itertools.accumulate(self.query_lens_cpu)]

    def to(self, device) -> AttentionMetadata:
        return AttentionMetadata(
            self.query_start_loc.to(device),
            self.context_lens.to(device),
            self.block_tables.to(device),
            self.slot_mapping.to(device),
            list(self.query_lens_cpu),
            list(self.context_lens_cpu),
        )


@dataclass(frozen=True)
class AttentionParams:
    """What one layer's attention computes besides q, K and V (the layer carries it; every backend honours it)."""

    scale: float  # multiplies q.k before the softmax: 1/sqrt(head_dim) unless the family says otherwise
    sliding_window: int | None = None  # a query sees at most this many keys, itself included; None: all before it
    logit_softcap: float | None = None  # scores become cap * tanh(score / cap) before the softmax (Gemma 2)

    @classmethod
    def plain(cls, head_dim: int) -> AttentionParams:
        """Softmax attention over the whole context, scaled by 1/sqrt(head_dim)."""
        return cls(head_dim**-0.5)

    def first_key(self, context_len: int) -> int:
        """The first position a query at the context's end (position context_len - 1) attends to."""
        return max(0, context_len - self.sliding_window) if self.sliding_window else 0


class AttentionBackend(Protocol):
    """Attends every query to its own request's keys. The cache already holds this iteration's K/V: the model
    writes them (`write_kv`) in the token-wise code before attention, where RoPE and the write fuse. Keys before
    a request's sliding window are never read: their blocks may already belong to someone else."""

    graph_safe_decode: bool  # whether whole decode steps around forward_decode should be captured as CUDA graphs
    label: str  # what runs, in the server's startup block

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams | None = None
    ) -> torch.Tensor:
        """q: [T, Hq, D] (rows may be strided, heads and head_dim dense); returns [T, Hq, D].
        params None: AttentionParams.plain(D)."""
        ...

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams | None = None
    ) -> torch.Tensor:
        """`forward` for a batch of one query per request that reads only device tensors and static shapes
        (never the host length lists), so a whole decode step can be captured as a CUDA graph."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into their cache slots, in place."""
    if torch.compiler.is_compiling():
        # An op boundary: traced as an index_put, Inductor (torch 2.11) copied the whole cache around every layer's
        # write; a custom op that mutates its argument is written in place (as vLLM's are).
        # Eagerly, the plain function: the op's dispatch would cost more than the write on the CPU.
        torch.ops.orcinus.write_kv(k, v, kv_cache, slot_mapping)
    else:
        scatter_kv(k, v, kv_cache, slot_mapping)


def scatter_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv = torch.stack((k, v)).transpose(1, 2).to(kv_cache.dtype)  # a 16-bit cache rounds to nearest even here
    kv_cache.view(2, num_kv_heads, -1, head_dim)[:, :, slot_mapping] = kv


@torch.library.custom_op("orcinus::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    scatter_kv(k, v, kv_cache, slot_mapping)


@_write_kv_op.register_fake
def _(k, v, kv_cache, slot_mapping) -> None:
    return None


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] cache, [..., nb] tables -> [Hkv, ..., nb * bs, D] (one copy)."""
    return cache[:, block_tables].flatten(-3, -2)
