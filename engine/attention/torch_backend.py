"""The PyTorch reference attention: runs anywhere, and is what every kernel is checked against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention.backend import gather_context, write_kv


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
