"""Every prefill chunk of a batch in one variable-length flash-attention call, instead of one SDPA per request.

A step's chunks are gathered from the paged cache into one packed K/V (`[total_keys, Hkv, D]`, one copy for
keys and values together) and attended with cumulative lengths, causal from the bottom right: a chunk's
queries are the last of its context's positions. The gather plan depends only on the step's metadata, so
it is built once per step and shared by every layer; a layer then costs a fixed handful of launches
however many chunks there are (per request it was ~12, run eagerly between the piecewise graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, AttentionParams
from engine.attention.torch_backend import attend


@dataclass
class PrefillPlan:
    """Where a step's multi-token queries sit and where their contexts' keys live, as device tensors."""

    rows: torch.Tensor  # [total_queries] int64: the flattened batch's rows of the prefill queries, request-major
    slots: torch.Tensor  # [total_keys] int64: cache slot of each context token, request-major
    cu_queries: torch.Tensor  # [P + 1] int32: request p's queries are packed rows [cu[p], cu[p+1])
    cu_keys: torch.Tensor  # [P + 1] int32: request p's keys are packed rows [cu[p], cu[p+1])
    max_queries: int
    max_keys: int

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, window: int | None = None) -> PrefillPlan | None:
        """The plan for meta's requests with more than one query; None if there are none. With a sliding window
        only the keys some query sees are gathered: the queries stay the last of their keys."""
        ids = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
        if not ids:
            return None
        starts = meta.query_starts_cpu
        q_lens = torch.tensor([meta.query_lens_cpu[i] for i in ids])
        first = torch.tensor(
            [max(0, meta.context_lens_cpu[i] - meta.query_lens_cpu[i] + 1 - window) if window else 0 for i in ids]
        )
        k_lens = torch.tensor([meta.context_lens_cpu[i] for i in ids]) - first
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in ids])
        owner = torch.repeat_interleave(torch.tensor(ids), k_lens)  # the batch row of each key's request
        positions = (
            torch.arange(int(k_lens.sum()))
            - torch.repeat_interleave(_offsets(k_lens)[:-1], k_lens)
            + torch.repeat_interleave(first, k_lens)
        )
        # One host-to-device copy for all of it; pinned, so it does not wait for the queued kernels.
        host = torch.cat([rows, owner, positions, _offsets(q_lens), _offsets(k_lens)])
        device = meta.block_tables.device
        if device.type == "cuda":
            host = host.pin_memory()
        rows, owner, positions, cu_q, cu_k = host.to(device, non_blocking=True).split(
            [len(rows), len(owner), len(positions), len(ids) + 1, len(ids) + 1]
        )
        slots = meta.block_tables[owner, positions // block_size].long() * block_size + positions % block_size
        return cls(rows, slots, cu_q.int(), cu_k.int(), int(q_lens.max()), int(k_lens.max()))


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])


def attend_prefills(q, kv_cache, plan: PrefillPlan, out, varlen, params: AttentionParams) -> None:
    """The plan's queries against their contexts through `varlen` (flash_varlen, or reference_varlen), into out."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    kv = kv_cache.view(2, num_kv_heads, -1, head_dim)[:, :, plan.slots]  # [2, Hkv, total_keys, D]
    kv = kv.permute(0, 2, 1, 3).contiguous().to(q.dtype)  # [2, total_keys, Hkv, D]: flash reads rows of heads
    o = varlen(q[plan.rows], kv[0], kv[1], plan.cu_queries, plan.cu_keys, plan.max_queries, plan.max_keys, params)
    out.index_copy_(0, plan.rows, o)


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, params: AttentionParams) -> torch.Tensor:
    """PyTorch's FlashAttention-2 over packed sequences (GQA native; causal aligned to each sequence's end; a
    sliding window as its left window). bfloat16/float16 on sm80+ only; no soft cap (the backend checks)."""
    left = params.sliding_window - 1 if params.sliding_window else None
    return torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        False,
        scale=params.scale,
        window_size_left=left,
        window_size_right=0 if left is not None else None,
    )[0]


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, params: AttentionParams) -> torch.Tensor:
    """flash_varlen's contract, one attention per sequence: the check for the plumbing around it, on any device."""
    out = torch.empty_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for p in range(len(cq) - 1):
        query, key, value = (
            t[a:b].transpose(0, 1)[None]
            for t, a, b in ((q, cq[p], cq[p + 1]), (k, ck[p], ck[p + 1]), (v, ck[p], ck[p + 1]))
        )
        n, ctx = query.shape[2], key.shape[2]
        key_pos = torch.arange(ctx, device=q.device)[None, :]
        query_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = key_pos <= query_pos
        if params.sliding_window:
            mask &= key_pos > query_pos - params.sliding_window
        out[cq[p] : cq[p + 1]] = attend(query, key, value, mask, params)[0].transpose(0, 1)
    return out
