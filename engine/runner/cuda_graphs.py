"""CUDA graphs for the token-wise segments of the forward pass; attention runs eagerly between them.

A forward pass over L layers is L + 1 token-wise segments cut at the attentions:
    embed -> pre_attn[0] | attn | post_attn[0] -> pre_attn[1] | attn | ... | post_attn[L-1] -> norm
Each segment is captured once per token-count bucket (1, 2, 4, 8, then multiples of 8), largest
first, all into one memory pool: only one bucket replays at a time, so they can share it. A batch
of T tokens is padded up to the smallest bucket >= T. Padding rows hold stale but valid ids and
positions; every token-wise op is row-independent, so they never touch the real rows, and attention
and the LM head only ever see the first T rows.

Graph inputs are static buffers (ids, positions, the attention output), and each segment's
outputs are the next one's inputs, held for the graph's lifetime. Off a GPU a "capture" keeps the
function and a replay re-runs it into the same static outputs, so the segmenting, the padding and
the buffer plumbing are exercised by CPU tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.llama import LlamaModel

Outputs = tuple[torch.Tensor, ...]


def graph_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to the first bucket that holds max_tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    buckets = [1]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2 if buckets[-1] < 8 else buckets[-1] + 8)
    return buckets


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket that holds num_tokens, or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= num_tokens:
            return b
    return None


class _CudaCapture:
    """Captures into one shared pool; warm-up runs first, outside capture, so cuBLAS sets up its workspace."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        self.device = device
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Outputs, Callable[[], None]]:
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        self.graphs.append(graph)
        return outputs, graph.replay


class _EagerCapture:
    """The CPU stand-in: a replay re-runs the segment and copies its results into the static outputs."""

    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Outputs, Callable[[], None]]:
        outputs = fn()

        def replay() -> None:
            for static, fresh in zip(outputs, fn()):
                static.copy_(fresh)

        return outputs, replay


class CudaGraphRunner:
    """Replays the captured segments of the bucket that fits a batch; larger batches return None (run eager)."""

    def __init__(self, model: LlamaModel, max_tokens: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.buckets = graph_buckets(max_tokens)
        largest = self.buckets[-1]
        s = model.shape
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(largest, s.num_heads, s.head_dim, dtype=dtype, device=device)
        self.capture = _CudaCapture(device) if device.type == "cuda" else _EagerCapture()
        self.segments: dict[int, list[tuple[Outputs, Callable[[], None]]]] = {}
        with torch.inference_mode():
            for bucket in reversed(self.buckets):  # largest first: smaller ones fit in the pool it grew
                self.segments[bucket] = self._capture_bucket(bucket)

    def _capture_bucket(self, n: int) -> list[tuple[Outputs, Callable[[], None]]]:
        model, layers = self.model, self.model.layers
        ids, pos, attn = self.input_ids[:n], self.positions[:n], self.attn_out[:n]

        def first() -> Outputs:
            x = model.embed_tokens(ids)
            return (x, *layers[0].pre_attention(x, pos, model.rotary))

        def between(i: int, x_prev: torch.Tensor) -> Callable[[], Outputs]:
            def segment() -> Outputs:
                x = layers[i - 1].post_attention(x_prev, attn)
                return (x, *layers[i].pre_attention(x, pos, model.rotary))
            return segment

        def last(x_prev: torch.Tensor) -> Callable[[], Outputs]:
            return lambda: (model.norm(layers[-1].post_attention(x_prev, attn)),)

        segments = [self.capture(first)]
        for i in range(1, len(layers)):
            segments.append(self.capture(between(i, segments[-1][0][0])))
        segments.append(self.capture(last(segments[-1][0][0])))
        return segments

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(self.buckets, num_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits like LlamaModel.forward, or None when no bucket holds the batch."""
        t = input_ids.shape[0]
        bucket = self.bucket_for(t)
        if bucket is None:
            return None
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        segments = self.segments[bucket]
        for (outputs, replay), kv_cache in zip(segments, kv_caches):
            replay()
            _, q, k, v = outputs
            self.attn_out[:t].copy_(attention.forward(q[:t], k[:t], v[:t], kv_cache, meta))
        (hidden,), replay = segments[-1]
        replay()
        return self.model.lm_head(hidden[logits_indices]).float()
