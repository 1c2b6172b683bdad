"""Piecewise CUDA graphs: the token-wise segments of the forward pass, with attention run eagerly between them.

A forward pass over L layers is L + 1 token-wise segments cut at the attentions
(engine/runner/token_segments.py):
    embed -> pre_attn[0] | attn | post_attn[0] -> pre_attn[1] | attn | ... | post_attn[L-1] -> norm
Each segment is captured once per token-count bucket (1, 2, 4, 8, multiples of 8 to 512, then of 64),
largest first, all into one memory pool. Every segment of every bucket reads and writes views of ONE set of
static buffers sized for the largest bucket (ids, positions, slot mapping, the residual stream x, q,
the attention output): only one bucket replays at a time, so they can share them, and the pool holds
only one segment's temporaries. (Keeping each bucket's own outputs alive would hold a set per
bucket, hundreds of them.) The pre-attention halves write K/V into the layers' caches, so those exist before capture.

A batch of T tokens is padded up to the smallest bucket >= T. Padding rows hold stale but valid ids
and positions, and write their K/V into the scratch block the runner keeps outside the scheduler's
pool; every token-wise op is row-independent, so they never touch the real rows, and attention and
the LM head only ever see the first T rows. Off a GPU a "capture" keeps the function and a replay
re-runs it, so the segmenting, the padding and the buffer plumbing are tested on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ClassVar

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.decoder import Decoder
from engine.runner.token_segments import EAGER, Segments

log = logging.getLogger(__name__)


def graph_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, multiples of 8 to 512, then multiples of 64, up to the first bucket that holds max_tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    buckets = [1]
    while buckets[-1] < max_tokens:
        b = buckets[-1]
        # Past 512 rows a step is GEMM time more than launch time: padding by up to 63 rows costs little, and
        # the coarser steps keep a 2048-token budget at 91 buckets instead of 259.
        buckets.append(b * 2 if b < 8 else b + 8 if b < 512 else b + 64)
    return buckets


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket that holds num_tokens, or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= num_tokens:
            return b
    return None


class CudaCapture:
    """Captures into one shared pool; each function runs once outside capture first (cuBLAS workspace, lazy init)."""

    def __init__(self, device: torch.device, pool=None):
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.device = device
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # capture_error_mode "thread_local": other threads (the gateway's, NCCL's) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        self.graphs.append(graph)
        return graph.replay


class EagerCapture:
    """The CPU stand-in: a replay re-runs the function, which writes into the same static buffers."""

    graphs: ClassVar[list] = []

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        return fn


def make_capture(device: torch.device, pool=None):
    return CudaCapture(device, pool) if device.type == "cuda" else EagerCapture()


def memory_in_use(device: torch.device) -> int:
    """Bytes the caching allocator holds, without its idle cache: capture empties that cache on entry, so a
    reading taken with it would make capture look like it freed memory (seen: "-2810 MiB")."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


class CudaGraphRunner:
    """Replays the captured segments of the bucket that fits a batch; larger batches return None (run eager)."""

    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        scratch_block: int,
        device: torch.device,
        dtype: torch.dtype,
        capture=None,
        segments: Segments = EAGER,
    ):
        self.model, self.kv_caches, self.segments = model, kv_caches, segments
        self.buckets = graph_buckets(max_tokens)
        n, s = self.buckets[-1], model.shape

        def buf(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buf(n, dtype=torch.int64), buf(n, dtype=torch.int64)
        # Capture, and padding rows at replay, write slot 0 of the scratch block.
        self.scratch_slot = scratch_block * kv_caches[0].shape[3]
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.x = buf(n, s.hidden_size)
        self.q = buf(n, s.num_heads, s.head_dim)
        self.attn_out = buf(n, s.num_heads, s.head_dim)
        self.capture = capture or make_capture(device)
        start, before = time.perf_counter(), memory_in_use(device)
        self.replays: dict[int, list[Callable[[], None]]] = {}
        with torch.inference_mode():
            for bucket in reversed(self.buckets):  # largest first: smaller ones fit in the pool it grew
                self.replays[bucket] = self._capture_bucket(bucket)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = memory_in_use(device) - before
        log.info(
            "captured %d piecewise CUDA graphs (%d token buckets up to %d) in %.1f s, %.0f MiB",
            len(self.buckets) * (len(model.layers) + 1),
            len(self.buckets),
            n,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def _capture_bucket(self, n: int) -> list[Callable[[], None]]:
        model, layers, caches, seg = self.model, self.model.layers, self.kv_caches, self.segments
        ids, pos, slots = self.input_ids[:n], self.positions[:n], self.slot_mapping[:n]
        x, q, attn = self.x[:n], self.q[:n], self.attn_out[:n]

        def first() -> None:
            seg.enter(model, layers[0], ids, pos, caches[0], slots, x, q)

        def between(i: int) -> Callable[[], None]:
            return lambda: seg.between(layers[i - 1], layers[i], x, attn, pos, caches[i], slots, q)

        def last() -> None:
            seg.leave(model, layers[-1], x, attn)

        return [self.capture(f) for f in [first, *(between(i) for i in range(1, len(layers))), last]]

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(self.buckets, num_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Logits like Decoder.forward (every row final-normed for logits_indices None), or None when no bucket
        holds the batch."""
        t = input_ids.shape[0]
        bucket = self.bucket_for(t)
        if bucket is None:
            return None
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:bucket].fill_(self.scratch_slot)  # rows a larger batch left behind last time
        replays, q, attn_out = self.replays[bucket], self.q[:t], self.attn_out[:t]
        for replay, kv_cache, layer in zip(replays, self.kv_caches, self.model.layers):
            replay()
            attn_out.copy_(attention.forward(q, kv_cache, meta, layer.attn_params))
        replays[-1]()
        if logits_indices is None:
            return self.x[:t]  # read before the next replay overwrites it
        return self.model.logits(self.x[logits_indices])
