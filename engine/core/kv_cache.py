"""Owns the KV cache blocks: who holds which, and how many a request may take."""

from __future__ import annotations

from typing import Callable

from engine.core.request import Request


def _paged(req: Request, num_tokens: int) -> int:
    return num_tokens


def _orca_reserve(req: Request, num_tokens: int) -> int:
    # Orca's own policy: a request holds slots for its prompt plus max_tokens from admission on.
    return max(num_tokens, req.max_total_tokens)


# How many token slots a request must hold once it has `num_tokens` tokens computed.
KV_POLICIES: dict[str, Callable[[Request, int], int]] = {"paged": _paged, "orca-reserve": _orca_reserve}


class KVCacheManager:
    """A free list of fixed-size blocks; each request's block table grows as its tokens are computed."""

    def __init__(self, num_blocks: int, block_size: int, policy: str = "paged"):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots_needed = KV_POLICIES[policy]
        # LIFO: recently freed blocks are reused first (warm in cache).
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `req.block_table` so its next `num_new_tokens` tokens have slots; False if blocks run out."""
        target = self.slots_needed(req, req.num_computed_tokens + num_new_tokens)
        missing = self.blocks_for(target) - len(req.block_table)
        if missing <= 0:
            return True
        if missing > len(self.free_blocks):
            return False
        for _ in range(missing):
            req.block_table.append(self.free_blocks.pop())
        return True

    def free(self, req: Request) -> None:
        self.free_blocks.extend(reversed(req.block_table))
        req.block_table = []
