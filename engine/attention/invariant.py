"""Attention for --batch-invariant: every query, prefill tokens included, through the paged C++ decode op.

The C++ op sums one query's keys in one fixed order whatever else is in the batch. SDPA, which the CPU backend runs
for prefills, splits a chunk's keys into blocks whose size follows the chunk's context length, so a prompt token's
output would depend on where the scheduler cut the prompt (which depends on the other requests' tokens) and on
whether its prefix came from the cache. Here a prompt token at position p is a decode query against the p + 1 keys
up to it: the same sums however the prompt was split, alone or in any batch. Costlier for long prompts (no blocked
matmul over a chunk's queries), which is the mode's price.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, AttentionParams
from engine.attention.cpu_backend import CpuAttention


class BatchInvariantAttention(CpuAttention):
    """Each query row against its own request's keys up to its own position, through the paged decode op."""

    label = "C++ paged, one query at a time (batch-invariant)"

    def __init__(self):
        super().__init__()
        self._rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None  # this step's, for every layer

    def forward(self, q, kv_cache, meta, params: AttentionParams | None = None):
        params = params or AttentionParams.plain(q.shape[-1])
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, *self._query_rows(meta))
        _, requests, lens = self._rows
        return self._decode(q, kv_cache, meta.block_tables, requests, lens, params)

    @staticmethod
    def _query_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query row's request (its block table) and context length (its position + 1)."""
        counts = torch.tensor(meta.query_lens_cpu)
        request = torch.repeat_interleave(torch.arange(meta.num_requests), counts)  # [T]: each row's request
        # Row j of request i (n queries, ctx keys once written) sits at position ctx - n + j: it sees ctx - n + j + 1.
        starts = torch.tensor(meta.context_lens_cpu) - counts
        within = torch.arange(len(request)) - torch.repeat_interleave(torch.tensor(meta.query_starts_cpu[:-1]), counts)
        lens = (starts[request] + within + 1).to(torch.int32)
        return request.to(torch.int32), lens
