"""Ragged attention over the paged KV cache, behind a backend interface.

Selective batching: every token-wise op runs on the flattened `[T, hidden]` batch; only
attention is split per request, driven by this metadata. A KV cache layer is one tensor
`[2, num_kv_heads, num_blocks, block_size, head_dim]` (keys, then values; head-major so that
a gathered context is already `[heads, tokens, head_dim]` for matmul); token `t` of a request
lives in slot `block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flattened batch and where its keys live."""

    query_start_loc: torch.Tensor  # [B + 1] int32: request i's queries are rows [qsl[i], qsl[i+1])
    context_lens: torch.Tensor  # [B] int32: tokens in cache once this iteration's K/V are written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    query_lens_cpu: list[int]  # host copies, so backends need no device sync to loop
    context_lens_cpu: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)


class AttentionBackend(Protocol):
    """Writes this iteration's K/V into the cache, then attends every query to its own request's keys."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] cache, [..., nb] tables -> [Hkv, ..., nb * bs, D] (one copy)."""
    return cache[:, block_tables].flatten(-3, -2)


class TorchAttention:
    """The PyTorch reference: decodes batched with a length mask, each prefill through SDPA."""

    def forward(self, q, k, v, kv_cache, meta):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc.tolist()
        decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode_rows:
            self._decode(q, kv_cache, meta, decode_rows, qsl, out)
        for i, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                self._prefill(q, kv_cache, meta, i, qsl, out)
        return out

    def _decode(self, q, kv_cache, meta, rows, qsl, out):
        num_kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        lens = [meta.context_lens_cpu[i] for i in rows]
        tables = meta.block_tables[rows, : -(-max(lens) // block_size)].long()  # [B, nb]
        keys = gather_context(kv_cache[0], tables)  # [Hkv, B, L, D]
        values = gather_context(kv_cache[1], tables)
        token_rows = torch.tensor([qsl[i] for i in rows], device=q.device)
        b, num_heads = len(rows), q.shape[1]
        # [B, Hq, D] -> [Hkv, B, G, D]: each KV head serves its group of G query heads.
        query = q[token_rows].view(b, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) / math.sqrt(head_dim)
        pad = torch.arange(keys.shape[2], device=q.device) >= torch.tensor(lens, device=q.device)[:, None]  # [B, L]
        scores.masked_fill_(pad[None, :, None, :], float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1), values.float())  # [Hkv, B, G, D]
        out[token_rows] = o.transpose(0, 1).reshape(b, num_heads, head_dim).to(out.dtype)

    def _prefill(self, q, kv_cache, meta, i, qsl, out):
        block_size = kv_cache.shape[3]
        n, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
        table = meta.block_tables[i, : -(-ctx // block_size)].long()
        keys = gather_context(kv_cache[0], table)[:, :ctx]  # [Hkv, ctx, D]
        values = gather_context(kv_cache[1], table)[:, :ctx]
        query = q[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [Hq, n, D]
        if n == ctx:
            mask, causal = None, True
        else:
            # Queries are the last n of ctx positions (chunked prefill, or recompute after preemption).
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
            causal = False
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)


def _cuda_backend():
    from engine.cuda_attention import CudaAttention  # lazy: CuPy is optional

    return CudaAttention()


def _auto_backend():
    from engine.cuda_attention import cuda_backend_available

    return _cuda_backend() if cuda_backend_available() else TorchAttention()


# "auto": the CUDA kernels when torch sees a GPU and CuPy imports, else the PyTorch reference.
BACKENDS = {"torch": TorchAttention, "cuda": _cuda_backend, "auto": _auto_backend}


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
