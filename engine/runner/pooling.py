"""Embeddings: each pooling request's final normed hidden states, pooled over its prompt (last row, or mean).

A long prompt runs in several chunks, so mean pooling keeps a running float64 sum per request between steps; a
chunk starting at position 0 (a first chunk, or a preempted request's recomputation) starts the sum afresh.
"""

from __future__ import annotations

import torch

from engine.core.batch import Batch


class Pooler:
    """Running sums of the mean-pooled requests' rows, and the pooled vectors a step finished."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    @staticmethod
    def wants(batch: Batch) -> bool:
        return any(r.pooling for r in batch.requests)

    def pool(self, batch: Batch, normed: torch.Tensor) -> dict[str, list[float]]:
        """Add this step's rows; each request whose prompt's last chunk ran gets its pooled float32 vector."""
        out, start = {}, 0
        for r in batch.requests:
            n, rows = len(r.token_ids), None
            if r.pooling:
                rows = normed[start : start + n]
            start += n
            if rows is None:
                continue
            if r.pooling == "mean":
                chunk = rows.double().sum(dim=0)
                total = self.sums.get(r.request_id) if r.num_computed_tokens else None
                self.sums[r.request_id] = chunk if total is None else total + chunk
                if r.sample:
                    total = self.sums.pop(r.request_id)
                    out[r.request_id] = (total / (r.num_computed_tokens + n)).float().cpu().tolist()
            elif r.sample:
                out[r.request_id] = rows[-1].float().cpu().tolist()
        return out

    def forget(self, request_ids) -> None:
        """Drop the sums of requests that will not come back (released by the engine, or failed in a step)."""
        for rid in request_ids:
            self.sums.pop(rid, None)
