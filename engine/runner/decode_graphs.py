"""Whole-iteration CUDA graphs for pure-decode batches: every layer, attention included, in one replay.

Piecewise graphs still pay a Python attention call per layer between replays; a decode step of a
small model is mostly that. When every request in a batch decodes one token, the whole forward pass
(the token-wise segments of engine/runner/token_segments.py, the backend's graph-safe
`forward_decode` between them, the LM head) is captured per batch-size bucket. Attention then reads
its metadata from static device buffers filled before each replay: block tables, context lengths,
slot mapping. Nothing inside depends on host values, so the kernel's grid is fixed at capture for
the longest context (empty KV splits cost one early exit).

Padding rows (a batch of 3 replays bucket 4) decode a dummy token against the scratch KV block the
runner keeps outside the scheduler's pool, so they never write into a real request's cache.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.decoder import Decoder
from engine.runner.cuda_graphs import bucket_for, graph_buckets, make_capture, memory_in_use
from engine.runner.token_segments import EAGER, Segments

log = logging.getLogger(__name__)


class DecodeGraphRunner:
    """Replays the whole-model graph of the bucket that holds a pure-decode batch; larger ones return None."""

    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        attention: AttentionBackend,
        max_seqs: int,
        scratch_block: int,
        device: torch.device,
        capture=None,
        segments: Segments = EAGER,
    ):
        self.model, self.kv_caches, self.attention, self.segments = model, kv_caches, attention, segments
        self.buckets = graph_buckets(max_seqs)
        self.block_size = kv_caches[0].shape[3]
        self.scratch_block = scratch_block
        n = self.buckets[-1]
        max_blocks = -(-model.max_position // self.block_size)

        def buf(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buf(n, dtype=torch.int64), buf(n, dtype=torch.int64)
        self.slot_mapping = buf(n, dtype=torch.int64)
        self.context_lens = buf(n)
        self.block_tables = buf(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.logits = torch.zeros(n, model.shape.vocab_size, dtype=torch.float32, device=device)
        s, dtype = model.shape, kv_caches[0].dtype
        self.x = torch.zeros(n, s.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(n, s.num_heads, s.head_dim, dtype=dtype, device=device)
        self._pad(0, n)
        self.capture = capture or make_capture(device)
        start, before = time.perf_counter(), memory_in_use(device)
        self.replays = {}
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                self.replays[bucket] = self.capture(self._whole_step(bucket))
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = memory_in_use(device) - before
        log.info("captured %d whole-decode CUDA graphs (batch buckets up to %d) in %.1f s, %.0f MiB",
                 len(self.buckets), n, self.capture_seconds, self.capture_bytes / 2**20)

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) decode one dummy token into slot 0 of the scratch block."""
        self.slot_mapping[start:stop] = self.scratch_block * self.block_size
        self.context_lens[start:stop] = 1
        self.block_tables[start:stop, 0] = self.scratch_block

    def _whole_step(self, n: int):
        model = self.model
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1],
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            query_lens_cpu=[1] * n,
            # An upper bound only: graph-safe attention never reads host lengths.
            context_lens_cpu=[self.block_tables.shape[1] * self.block_size] * n,
        )
        ids, pos, slots, logits = self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.logits[:n]
        x, q, layers, caches, seg = self.x[:n], self.q[:n], model.layers, self.kv_caches, self.segments

        def step() -> None:
            seg.enter(model, layers[0], ids, pos, caches[0], slots, x, q)
            for i in range(1, len(layers)):
                attn = self.attention.forward_decode(q, caches[i - 1], meta, layers[i - 1].attn_params)
                seg.between(layers[i - 1], layers[i], x, attn, pos, caches[i], slots, q)
            seg.leave(model, layers[-1], x, self.attention.forward_decode(q, caches[-1], meta, layers[-1].attn_params))
            logits.copy_(model.logits(x))

        return step

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.buckets, num_seqs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits [B, vocab] of a batch whose B requests each decode one token, or None if no bucket holds it."""
        b = input_ids.shape[0]
        bucket = self.bucket_for(b)
        if bucket is None:
            return None
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self._pad(b, bucket)  # rows a larger batch left behind last time
        self.replays[bucket]()
        return self.logits[:b]
