"""Runs one iteration: turns a Batch into flat tensors and returns the logits of the rows to sample."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, make_backend
from engine.config import EngineConfig, ModelShape
from engine.model import LlamaModel
from engine.scheduler import Batch


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * elem


class ModelRunner:
    """Owns the model, the KV cache tensors and the attention backend."""

    def __init__(self, config: EngineConfig, model: LlamaModel, num_blocks: int):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        s = model.shape
        self.kv_caches = [
            torch.zeros(2, s.num_kv_heads, num_blocks, config.block_size, s.head_dim, dtype=self.dtype, device=self.device)
            for _ in range(s.num_layers)
        ]
        self.attention = make_backend(config.attention_backend)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [num_sampled, vocab] (float32), in batch order of the requests that sample."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        return self.model(input_ids, positions, self.kv_caches, meta, self.attention, logits_indices)

    def prepare(self, batch: Batch):
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, logits_indices = [], [], []
        query_start = [0]
        for r in batch.requests:
            n, start = len(r.token_ids), r.num_computed_tokens
            input_ids += r.token_ids
            pos = range(start, start + n)
            positions += pos
            slots += [r.block_table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            context_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if r.sample:
                logits_indices.append(query_start[-1] - 1)
        max_blocks = max(len(r.block_table) for r in batch.requests)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in batch.requests]

        def t(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=t(query_start, torch.int32),
            context_lens=t(context_lens, torch.int32),
            block_tables=t(tables, torch.int32),
            slot_mapping=t(slots),
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )
        return t(input_ids), t(positions), meta, t(logits_indices)
