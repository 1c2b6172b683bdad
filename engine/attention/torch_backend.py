"""The PyTorch reference attention: runs anywhere, and is what every kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import MAX_DECODE_LIKE_QUERIES, AttentionParams, gather_context


class TorchAttention:
    """The PyTorch reference: decodes batched with a length mask, each prefill through SDPA."""

    # Capturable, but a captured forward_decode gathers every request's whole window: not worth it on a GPU.
    graph_safe_decode = False
    label = "PyTorch reference"
    # Requests whose context is at most this many keys attend as decode queries whatever their number of queries
    # (the reference's decode pads every row to the longest context: only the few queries of a verification do).
    decode_like_context = 0

    def forward(self, q, kv_cache, meta, params: AttentionParams | None = None):
        params = params or AttentionParams.plain(q.shape[-1])
        if meta.is_pure_decode:  # row i is request i, no gathers needed
            tables = meta.block_tables[:, : -(-meta.max_context_len // kv_cache.shape[3])]
            return self._decode(q, kv_cache, tables, None, meta.context_lens, params)
        d = meta.decode_rows(self.decode_like_context)  # decodes, requests verifying drafts, short prompts
        if d is not None:
            tables = meta.block_tables[:, : -(-d.max_context_len // kv_cache.shape[3])]
            if d.token_rows is None:
                return self._decode(q, kv_cache, tables, d.requests, d.context_lens, params)
        out = torch.empty_like(q)
        qsl = meta.query_starts_cpu
        if d is not None:
            out[d.token_rows] = self._decode(q[d.token_rows], kv_cache, tables, d.requests, d.context_lens, params)
        for i, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            if n > MAX_DECODE_LIKE_QUERIES and ctx > self.decode_like_context:
                attend_prefill(q, kv_cache, meta, i, qsl, out, params)
        return out

    def forward_decode(self, q, kv_cache, meta, params: AttentionParams | None = None):
        params = params or AttentionParams.plain(q.shape[-1])
        return self._decode(q, kv_cache, meta.block_tables, None, meta.context_lens, params)

    @staticmethod
    def _decode(q, kv_cache, tables, requests, lens, params: AttentionParams):
        """Query rows q [R, Hq, D], row r against the first lens[r] keys of block table requests[r] of tables [B, nb]
        (requests None: table r)."""
        num_kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        tables = tables if requests is None else tables[requests]
        tables, lens = tables.long(), lens.long()
        first_block = torch.zeros_like(lens)
        if params.sliding_window:  # only the blocks that hold a request's window: earlier ones may be reused
            first_block = (lens - params.sliding_window).clamp(min=0) // block_size
            width = min(tables.shape[1], -(-params.sliding_window // block_size) + 1)
            index = (first_block[:, None] + torch.arange(width, device=q.device)).clamp(max=tables.shape[1] - 1)
            tables = tables.gather(1, index)
        keys = gather_context(kv_cache[0], tables).transpose(0, 1).to(q.dtype)  # [B, Hkv, L, D]
        values = gather_context(kv_cache[1], tables).transpose(0, 1).to(q.dtype)
        b, num_heads = q.shape[0], q.shape[1]
        # A KV head's G query heads become G query rows against it: grouped-query attention without
        # repeating the keys, through SDPA's fused CPU kernel (float softmax) rather than ~8 separate ops.
        query = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        pos = first_block[:, None] * block_size + torch.arange(keys.shape[2], device=q.device)  # [B, L]
        mask = pos < lens[:, None]
        if params.sliding_window:
            mask &= pos >= lens[:, None] - params.sliding_window
        return attend(query, keys, values, mask[:, None, None, :], params).reshape(b, num_heads, head_dim)


def attend(query, keys, values, mask, params: AttentionParams, causal: bool = False):
    """[B, H, n, D] queries against [B, Hkv, L, D] keys and values (H a multiple of Hkv) where mask [.., n, L]
    allows (or causally, mask None): SDPA, or for soft-capped scores, which SDPA cannot take, the same in plain ops."""
    group = query.shape[1] // keys.shape[1]
    if params.logit_softcap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal, scale=params.scale, enable_gqa=group > 1
        )
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    cap = params.logit_softcap
    scores = torch.tanh(query.float() @ keys.float().transpose(-1, -2) * (params.scale / cap)) * cap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (weights @ values.float()).to(query.dtype)


def attend_prefill(q, kv_cache, meta, i, qsl, out, params: AttentionParams):
    """Request i's queries (rows qsl[i]:qsl[i+1]) against its cached context, written into out."""
    block_size = kv_cache.shape[3]
    n, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
    start = params.first_key(ctx - n + 1) // block_size  # whole blocks from the earliest key any query sees
    table = meta.block_tables[i, start : -(-ctx // block_size)].long()  # (blocks before it may be freed already)
    offset = start * block_size
    keys = gather_context(kv_cache[0], table)[:, : ctx - offset].to(q.dtype)  # [Hkv, L, D]
    values = gather_context(kv_cache[1], table)[:, : ctx - offset].to(q.dtype)
    query = q[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [Hq, n, D]
    mask, causal = None, n == ctx and not params.sliding_window
    if not causal:
        # Queries are the last n of ctx positions (chunked prefill, or recompute after preemption).
        key_pos = torch.arange(offset, ctx, device=q.device)[None, :]
        query_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = key_pos <= query_pos
        if params.sliding_window:
            mask &= key_pos > query_pos - params.sliding_window
    # 4-D inputs: 3-D ones fall to SDPA's unfused math path on the CPU, several times slower on a long prefill.
    o = attend(query[None], keys[None], values[None], mask, params, causal)[0]
    out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)
