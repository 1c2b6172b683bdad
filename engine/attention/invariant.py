"""Attention for --batch-invariant: every query, prefill tokens included, through the paged C++ decode op.

The C++ op sums one query's keys in one fixed order whatever else is in the batch. SDPA, which the CPU backend runs
for prompts past 1024 keys, splits a chunk's keys into blocks whose size follows the chunk's context length, so such
a prompt token's output would depend on where the scheduler cut the prompt (which depends on the other requests'
tokens) and on whether its prefix came from the cache. Here a prompt token at position p is a decode query against
the p + 1 keys up to it: the same sums however the prompt was split, alone or in any batch. Costlier for long prompts
(no blocked matmul over a chunk's queries), which is the mode's price.
"""

from __future__ import annotations

import sys

from engine.attention.cpu_backend import CpuAttention


class BatchInvariantAttention(CpuAttention):
    """Each query row against its own request's keys up to its own position, through the paged decode op."""

    label = "C++ paged, one query at a time (batch-invariant)"
    decode_like_context = sys.maxsize
