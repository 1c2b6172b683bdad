"""Tensor parallelism (Megatron-style, Orca's intra-layer parallelism): which slice of each weight a rank holds.

Q/K/V and gate/up are split by output rows (column-parallel: each rank computes its own heads and its share of
the MLP), the output and down projections by input columns (row-parallel: partial sums, one all-reduce each),
the embedding and LM head by vocabulary rows. KV heads, and so every KV block, are split with the query heads.
A rank's model is an ordinary Decoder of the local shape; these are the only places it talks to its peers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.core.config import ModelShape


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks."""


def check_splittable(shape: ModelShape, size: int) -> None:
    """Every split dimension must divide evenly (the vocabulary is padded instead)."""
    parts = {"attention heads": shape.num_heads, "KV heads": shape.num_kv_heads, "MLP width": shape.intermediate_size}
    bad = [f"{name} ({n})" for name, n in parts.items() if n % size]
    if size < 1 or bad:
        raise TensorParallelError(f"--tensor-parallel-size {size} must divide the model's {', '.join(bad) or 'sizes'}")


@dataclass(frozen=True)
class TensorShard:
    """This rank's place in its tensor-parallel group. The default, one rank of one, splits nothing."""

    rank: int = 0  # within the group
    size: int = 1  # ranks in the group
    group: Any = None  # the torch.distributed process group of the ranks sharing these layers
    via_host: bool = False  # CUDA tensors but a gloo group (ranks sharing a GPU): collectives go through host memory

    def local_shape(self, shape: ModelShape) -> ModelShape:
        """The shape this rank's layers and KV cache have; the vocabulary stays whole (logits are gathered)."""
        if self.size == 1:
            return shape
        check_splittable(shape, self.size)
        return dataclasses.replace(
            shape,
            num_heads=shape.num_heads // self.size,
            num_kv_heads=shape.num_kv_heads // self.size,
            intermediate_size=shape.intermediate_size // self.size,
        )

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds; each rank holds ceil(V / size) rows, the last padded."""
        per = -(-vocab_size // self.size)
        return self.rank * per, (self.rank + 1) * per

    def take(self, name: str, full: torch.Tensor, shape: ModelShape) -> torch.Tensor:
        """This rank's slice of the whole model's parameter `name` (fused names: `qkv_proj`, `gate_up_proj`)."""
        if self.size == 1 or name.endswith("norm.weight"):
            return full
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_range(shape.vocab_size)
            rows = full[start:end]
            return torch.cat([rows, rows.new_zeros(end - start - len(rows), *rows.shape[1:])])  # padding rows
        if ".qkv_proj." in name:
            q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            return torch.cat([self._part(t, 0) for t in full.split([q, kv, kv])])
        if ".gate_up_proj." in name:
            return torch.cat([self._part(t, 0) for t in full.chunk(2)])
        if ".o_proj." in name or ".down_proj." in name:
            return self._part(full, 1)
        raise KeyError(f"no tensor-parallel split for {name}")

    def _part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.size, dim=dim)[self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (row-parallel partial sums)."""
        if self.size == 1:
            return x
        y = x.cpu() if self.via_host else x
        dist.all_reduce(y, group=self.group)
        return y.to(x.device) if self.via_host else y

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, V / size] vocabulary-parallel logits -> [T, V] on every rank."""
        if self.size == 1:
            return logits
        local = logits.cpu() if self.via_host else logits.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size].to(logits.device)

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocabulary-parallel embedding: each rank looks up the ids it holds, zeros elsewhere, then sums."""
        if self.size == 1:
            return torch.nn.functional.embedding(input_ids, weight)
        start = self.rank * weight.shape[0]
        local = input_ids - start
        mine = (local >= 0) & (local < weight.shape[0])
        x = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight) * mine[:, None].to(weight.dtype)
        return self.all_reduce(x)


WHOLE = TensorShard()  # one rank of one: the whole model
