"""Whole-iteration CUDA graphs: every layer, attention included, in one replay, for steps of decode-like rows.

Piecewise graphs still pay a Python attention call per layer between replays, host time that made a step where a
prompt joins decoding requests several times a decode step (docs/performance.md, GPU: host-bound steps). Here every
row of the flattened batch attends as one decode query against its own request's keys up to its own position: a
decoding request's one row, and each row of a prompt chunk (causal, since row j of a chunk at position p sees keys
0..p). The whole forward pass (the token-wise segments of engine/runner/token_segments.py, the backend's
graph-safe `forward_decode` between them, the LM head over the rows that sample) is captured per row-count
bucket. Attention reads its metadata from static device buffers filled before each replay, and the per-row
context lengths and block tables are derived inside the graph from each row's position and request.

With a backend that tiles prompt rows (CudaAttention: csrc/cuda/paged_prompt_tiles.cu), a step's prompt rows go by
tiles of one request's consecutive rows, each K/V load serving rows x heads, and the decode kernel leaves them (their
context lengths are negated in the graph); the tile plan (engine/attention/prompt_tiles.py) is copied into a static
buffer before each replay. Without one, prompt rows re-read their request's keys one row at a time (from L2: a
chunk's keys are shared). Either way a step whose prompt rows would read more than PREFILL_KEY_BUDGET keys in all
(long chunks, or chunks after a long cached context) runs the piecewise graphs and flash attention instead.

Padding rows (3 rows replay bucket 4) decode a dummy token against the scratch KV block the runner keeps outside
the scheduler's pool, so they never write into a real request's cache.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.prompt_tiles import TILE_FIELDS, plan_prompt_tiles, prompt_row_signs, tile_capacity
from engine.core.config import EngineConfig
from engine.model.decoder import Decoder
from engine.runner.cuda_graphs import bucket_for, graph_buckets, make_capture, memory_in_use
from engine.runner.token_segments import EAGER, Segments

log = logging.getLogger(__name__)


MIN_ROWS = 512  # rows of the largest bucket at least (a prompt of up to this many tokens joins decodes in a replay)
# Keys the prompt rows of one step may read in all (row j of a chunk starting at s reads s + j + 1 of them): a
# 512-token prompt with nothing cached reads 131k; past this the per-row reads cost more than flash attention.
PREFILL_KEY_BUDGET = 1 << 18


def whole_step_rows(config: EngineConfig) -> int:
    """Rows of the largest whole-step bucket: max(max_num_seqs, MIN_ROWS), at most the token budget."""
    return min(config.max_num_batched_tokens, max(config.max_num_seqs, MIN_ROWS))


def prefill_key_reads(meta: AttentionMetadata) -> int:
    """Keys the rows of the step's multi-token chunks read in all, each row as a decode query at its position."""
    return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(meta.query_lens_cpu, meta.context_lens_cpu) if n > 1)


def row_requests(meta: AttentionMetadata) -> list[int]:
    """Each row's request: its index in the step."""
    return [i for i, n in enumerate(meta.query_lens_cpu) for _ in range(n)]


class DecodeGraphRunner:
    """Replays the whole-model graph of the row bucket that holds a step; steps it does not take return None."""

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
        max_rows: int | None = None,
    ):
        self.model, self.kv_caches, self.attention, self.segments = model, kv_caches, attention, segments
        self.buckets = graph_buckets(max_rows or max(max_seqs, MIN_ROWS))
        self.block_size = kv_caches[0].shape[3]
        self.scratch_block = scratch_block
        self.max_seqs = max_seqs
        n = self.buckets[-1]
        max_blocks = -(-model.max_position // self.block_size)

        def buf(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buf(n, dtype=torch.int64), buf(n, dtype=torch.int64)
        self.slot_mapping = buf(n, dtype=torch.int64)
        self.row_requests = buf(n, dtype=torch.int64)  # each row's request: a row of request_tables
        # The step's block tables by request; one more row, the scratch block's, for padding rows.
        self.request_tables = buf(max_seqs + 1, max_blocks)
        self.request_tables[max_seqs, 0] = scratch_block
        self.context_lens = buf(n)  # derived in the graph: each row's position + 1
        self.block_tables = buf(n, max_blocks)  # derived in the graph: its request's table
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.logit_rows = buf(min(n, max_seqs), dtype=torch.int64)  # rows whose logits are returned, in order
        self.logits = torch.zeros(min(n, max_seqs), model.shape.vocab_size, dtype=torch.float32, device=device)
        s, dtype = model.shape, kv_caches[0].dtype
        self.x = torch.zeros(n, s.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(n, s.num_heads, s.head_dim, dtype=dtype, device=device)
        tiles_for = getattr(attention, "prompt_tile_rows", None)
        self.tile_rows = tiles_for(dtype, s.num_heads, kv_caches[0].shape[1], s.head_dim, device) if tiles_for else 0
        # The tiles (rows 0: spare) and each row's sign (-1: a prompt row, which a tile attends) in one device buffer,
        # filled by one copy a step from two pinned host buffers used in turn (as the runner's inputs are). Tiles
        # first: the kernel reads each as one 16-byte load.
        self.tile_capacity = {b: tile_capacity(b, self.tile_rows, max_seqs) for b in self.buckets}
        spans = self.tile_capacity[n] * TILE_FIELDS
        self.tile_state = buf(spans + n)
        self.tiles, self.row_signs = self.tile_state[:spans].view(-1, TILE_FIELDS), self.tile_state[spans:]
        self.row_signs.fill_(1)
        pin = device.type == "cuda"
        self._tile_hosts = [torch.zeros(self.tile_state.shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._tile_turn = 0
        self._pad(0, n)
        self.capture = capture or make_capture(device)
        start, before = time.perf_counter(), memory_in_use(device)
        # With tiles, a second graph a bucket for steps with prompt rows: pure decode steps then launch no tile grid.
        self.replays, self.tiled_replays = {}, {}
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                self.replays[bucket] = self.capture(self._whole_step(bucket, tiled=False))
                if self.tile_capacity[bucket]:
                    self.tiled_replays[bucket] = self.capture(self._whole_step(bucket, tiled=True))
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = memory_in_use(device) - before
        log.info(
            "captured %d whole-step CUDA graphs (row buckets up to %d) in %.1f s, %.0f MiB",
            len(self.replays) + len(self.tiled_replays),
            n,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) decode one dummy token at position 0 of the scratch block."""
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = self.scratch_block * self.block_size
        self.row_requests[start:stop] = self.max_seqs

    def _whole_step(self, n: int, tiled: bool):
        model = self.model
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1],
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            query_lens_cpu=[1] * n,
            # An upper bound only: graph-safe attention never reads host lengths.
            context_lens_cpu=[self.block_tables.shape[1] * self.block_size] * n,
            prompt_tiles=self.tiles[: self.tile_capacity[n]] if tiled else None,
        )
        signs = self.row_signs[:n]
        ids, pos, slots = self.input_ids[:n], self.positions[:n], self.slot_mapping[:n]
        rows, tables, context_lens = self.row_requests[:n], self.block_tables[:n], self.context_lens[:n]
        logit_rows, logits = self.logit_rows[: min(n, self.max_seqs)], self.logits[: min(n, self.max_seqs)]
        x, q, layers, caches, seg = self.x[:n], self.q[:n], model.layers, self.kv_caches, self.segments

        def step() -> None:
            context_lens.copy_((pos + 1) * signs if tiled else pos + 1)
            torch.index_select(self.request_tables, 0, rows, out=tables)
            seg.enter(model, layers[0], ids, pos, caches[0], slots, x, q)
            for i in range(1, len(layers)):
                attn = self.attention.forward_decode(q, caches[i - 1], meta, layers[i - 1].attn_params)
                seg.between(layers[i - 1], layers[i], x, attn, pos, caches[i], slots, q)
            seg.leave(model, layers[-1], x, self.attention.forward_decode(q, caches[-1], meta, layers[-1].attn_params))
            logits.copy_(model.logits(x.index_select(0, logit_rows)))

        return step

    def bucket_for(self, num_rows: int) -> int | None:
        return bucket_for(self.buckets, num_rows)

    def takes(self, num_rows: int, num_logit_rows: int, meta: AttentionMetadata) -> bool:
        """Whether a step replays here: a bucket holds its rows, its sampled rows fit the logits buffer, and its
        prompt rows read few enough keys."""
        return (
            num_rows <= self.buckets[-1]
            and num_logit_rows <= min(num_rows, self.max_seqs)
            and (meta.is_pure_decode or prefill_key_reads(meta) <= PREFILL_KEY_BUDGET)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        row_requests: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits of the `logits_indices` rows of a step (`row_requests`: each row's request in `meta`), or None
        if no bucket holds it."""
        t = input_ids.shape[0]
        bucket = self.bucket_for(t)
        k = logits_indices.shape[0]
        if bucket is None or k > min(bucket, self.max_seqs):
            return None
        num_requests, width = meta.block_tables.shape
        tiled = self.tile_rows > 0 and not meta.is_pure_decode
        if tiled and not self._put_tiles(meta, t, bucket):
            return None
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.row_requests[:t].copy_(row_requests)
        self.request_tables[:num_requests, :width].copy_(meta.block_tables)
        m = min(bucket, self.max_seqs)
        self.logit_rows[:k].copy_(logits_indices)
        if k < m:  # a step before may have left rows past this bucket there: any row here will do
            self.logit_rows[k:m] = 0
        if t < bucket:
            self._pad(t, bucket)  # rows a larger step left behind last time
        (self.tiled_replays if tiled else self.replays)[bucket]()
        return self.logits[:k]

    def _put_tiles(self, meta: AttentionMetadata, num_rows: int, bucket: int) -> bool:
        """Stage the step's row signs and tile plan and start their copy; False if the bucket's grid cannot hold the
        plan (more requests than the graphs were built for)."""
        plan = plan_prompt_tiles(meta.query_lens_cpu, meta.context_lens_cpu, self.tile_rows, tables_by_row=True)
        if len(plan) > self.tile_capacity[bucket] or bucket not in self.tiled_replays:
            return False
        host = self._tile_hosts[self._tile_turn]
        self._tile_turn ^= 1
        spans = self.tiles.numel()
        flat = host.numpy()
        flat[:spans] = 0  # spare tiles: no rows
        flat[: plan.size] = plan.ravel()
        flat[spans:] = 1  # padding rows decode
        flat[spans : spans + num_rows] = prompt_row_signs(meta.query_lens_cpu, num_rows)
        self.tile_state.copy_(host, non_blocking=True)
        return True
