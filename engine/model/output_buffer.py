"""One layer's output memory kept from call to call, for a layer whose output is larger than what malloc recycles.

glibc serves an allocation above its mmap threshold (at most 32 MiB) with fresh pages and unmaps them when it is freed,
so each call's output faults in and zeroes every page again: for the LM head's logits at a large vocabulary and batch
(32 rows of a 262k vocabulary are 33.5 MB) that is a measurable share of the head's own time (docs/performance.md). A
layer that holds an OutputBuffer writes into the same pages every call instead; its caller must be done with one call's
output before the next call (the runner samples a step's logits before it runs the next).
"""

from __future__ import annotations

import torch


class OutputBuffer:
    """The largest output asked for so far, handed out again as [rows, cols] views of its first elements."""

    def __init__(self):
        self._memory: torch.Tensor | None = None

    def take(self, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """An uninitialized [rows, cols] tensor of `like`'s dtype and device: the kept memory, or new (then kept). Under
        inference mode only (the runner's forward): elsewhere a fresh tensor, which autograd may keep."""
        if not torch.is_inference_mode_enabled():
            return like.new_empty(rows, cols)
        n = rows * cols
        memory = self._memory
        if memory is None or memory.numel() < n or memory.dtype != like.dtype or memory.device != like.device:
            self._memory = memory = like.new_empty(n)
        return memory[:n].view(rows, cols)
