"""The PyTorch reference attention: runs anywhere, and is what every kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import gather_context


class TorchAttention:
    """The PyTorch reference: decodes batched with a length mask, each prefill through SDPA."""

    # Capturable, but a captured forward_decode gathers every request's whole window: not worth it on a GPU.
    graph_safe_decode = False

    def forward(self, q, kv_cache, meta):
        out = torch.empty_like(q)
        qsl = meta.query_starts_cpu
        decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if len(decode_rows) == meta.num_requests:  # pure decode: row i is request i, no gathers needed
            block_size = kv_cache.shape[3]
            tables = meta.block_tables[:, : -(-max(meta.context_lens_cpu) // block_size)]
            return self._decode(q, kv_cache, tables, meta.context_lens)
        if decode_rows:
            rows = torch.tensor(decode_rows, device=q.device)
            token_rows = torch.tensor([qsl[i] for i in decode_rows], device=q.device)
            width = -(-max(meta.context_lens_cpu[i] for i in decode_rows) // kv_cache.shape[3])
            out[token_rows] = self._decode(q[token_rows], kv_cache, meta.block_tables[rows, :width],
                                           meta.context_lens[rows])
        for i, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                attend_prefill(q, kv_cache, meta, i, qsl, out)
        return out

    def forward_decode(self, q, kv_cache, meta):
        return self._decode(q, kv_cache, meta.block_tables, meta.context_lens)

    @staticmethod
    def _decode(q, kv_cache, tables, lens):
        """One query per request: q [B, Hq, D] against each request's first lens[b] keys in tables [B, nb]."""
        num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
        keys = gather_context(kv_cache[0], tables.long()).transpose(0, 1)  # [B, Hkv, L, D]
        values = gather_context(kv_cache[1], tables.long()).transpose(0, 1)
        b, num_heads = q.shape[0], q.shape[1]
        # A KV head's G query heads become G query rows against it: grouped-query attention without
        # repeating the keys, through SDPA's fused CPU kernel (float softmax) rather than ~8 separate ops.
        query = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = (torch.arange(keys.shape[2], device=q.device) < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).reshape(b, num_heads, head_dim)


def attend_prefill(q, kv_cache, meta, i, qsl, out):
    """Request i's queries (rows qsl[i]:qsl[i+1]) against its cached context through SDPA, written into out."""
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
    # 4-D inputs: 3-D ones fall to SDPA's unfused math path on the CPU (a 2048-token prefill: 212 vs 36 ms a layer).
    o = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                       enable_gqa=True)[0]
    out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)
