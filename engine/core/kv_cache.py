"""Owns the KV cache blocks: who holds which, how many a request may take, and which full blocks are cached.

Automatic prefix caching (as in vLLM v1): a full block is named by a hash chained from its parent block's
hash and its own token ids, so two requests whose prompts share a prefix share its blocks (ref-counted). A
request's `cache_salt` is the first block's parent: requests with different salts never share a block (vLLM's
`cache_salt`; the gateway derives one per API key, so one tenant cannot time another's prompts).
A block nobody holds keeps its contents and name in the free queue until it is taken for other tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from engine.core.request import Request


def _paged(req: Request, num_tokens: int) -> int:
    return num_tokens


def _orca_reserve(req: Request, num_tokens: int) -> int:
    # Orca's own policy: a request holds slots for its prompt plus max_tokens from admission on.
    return max(num_tokens, req.max_total_tokens)


# How many token slots a request must hold once it has `num_tokens` tokens computed.
KV_POLICIES: dict[str, Callable[[Request, int], int]] = {"paged": _paged, "orca-reserve": _orca_reserve}


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """A block's name: SHA-256 of its parent's name and its tokens (a client cannot forge a collision)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def salt_root(cache_salt: bytes, lora_id: int = 0) -> bytes:
    """The first block's parent: nothing without a salt; with one, 33 bytes, a length no other parent has (names are
    32), so a salted first block can never take the name of an unsalted block. Under a LoRA adapter, 34 bytes of the
    salt's root and the adapter: its blocks hold K/V no other adapter (nor the base model) computes."""
    root = b"\0" + hashlib.sha256(cache_salt).digest() if cache_salt else b""
    return b"\1\1" + hashlib.sha256(root + lora_id.to_bytes(8, "little")).digest() if lora_id else root


class KVCacheManager:
    """Fixed-size blocks with reference counts; each request's block table grows as its tokens are computed."""

    def __init__(self, num_blocks: int, block_size: int, policy: str = "paged", prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots_needed = KV_POLICIES[policy]
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        # Blocks nobody holds, taken from the front. A freed cached block goes to the back, so the prefixes
        # used last stay findable longest; a freed block with nothing worth finding goes to the front and
        # is reused first (still warm in the CPU's caches).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # name -> block holding those tokens' K/V
        self.block_names: dict[int, bytes] = {}  # the reverse, for eviction
        # Names cached and evicted since the last drain_events(), when someone reads them (a cache-aware router).
        self.events: tuple[list[bytes], list[bytes]] | None = None

    def record_events(self) -> None:
        """From now on, keep the names of blocks cached and evicted until `drain_events()` takes them."""
        self.events = ([], [])

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Names (cached, evicted) since the last call, in order; a name may be in both."""
        if self.events is None:
            return [], []
        events, self.events = self.events, ([], [])
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: they can be taken whenever needed."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_cached_prefix(self, req: Request) -> int:
        """Give a request holding no blocks every cached full block of its prefix; returns the tokens covered.

        At least the last token is left to compute: its logits pick the next token.
        """
        if not self.prefix_caching or req.block_table:
            return 0
        num_full = (req.num_tokens - 1) // self.block_size
        self._name_blocks(req, num_full)
        for name in req.block_names[:num_full]:
            block = self.cached.get(name)
            if block is None:
                break
            self._hold(block)
            req.block_table.append(block)
        req.num_registered_blocks = len(req.block_table)
        return len(req.block_table) * self.block_size

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `req.block_table` so the `num_new_tokens` after those scheduled have slots; False if blocks run out."""
        # Per request per step: the properties' arithmetic written out.
        target = self.slots_needed(req, req.num_computed_tokens + req.num_in_flight_tokens + num_new_tokens)
        missing = -(-target // self.block_size) - len(req.block_table)
        if missing <= 0:
            return True
        if missing > len(self.free_queue):
            return False
        for _ in range(missing):
            block = next(iter(self.free_queue))
            name = self.block_names.pop(block, None)
            if name is not None:  # evict: its contents are about to be overwritten
                del self.cached[name]
                if self.events is not None:
                    self.events[1].append(name)
            self._hold(block)
            req.block_table.append(block)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Name the blocks `req` has filled since last time, so later requests with the same prefix find them."""
        num_full = req.num_computed_tokens // self.block_size
        if not self.prefix_caching or num_full <= req.num_registered_blocks:
            return  # nothing filled since (registered blocks are named): most decode steps
        self._name_blocks(req, num_full)
        for i in range(req.num_registered_blocks, num_full):
            name, block = req.block_names[i], req.block_table[i]
            if name not in self.cached:  # another block may hold the same tokens already: keep that one
                self.cached[name] = block
                self.block_names[block] = name
                if self.events is not None:
                    self.events[0].append(name)
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def free(self, req: Request) -> None:
        # Last block first, so a request's tail is evicted before its (more widely shared) head.
        for block in reversed(req.block_table[req.num_released_blocks :]):
            self._release(block)
        req.block_table = []
        req.num_sent_blocks = 0  # the next batch carries its new table whole
        req.num_registered_blocks = 0
        req.num_released_blocks = 0

    def release_before(self, req: Request, position: int) -> None:
        """Give back the blocks wholly before `position`, which no query of `req` will read again (they are before
        every layer's sliding window). Their table entries stay, stale, so positions still index the table."""
        end = min(max(0, position) // self.block_size, len(req.block_table))
        for block in req.block_table[req.num_released_blocks : end]:
            self._release(block)
        req.num_released_blocks = max(req.num_released_blocks, end)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if block not in self.block_names:
                self.free_queue.move_to_end(block, last=False)

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _name_blocks(self, req: Request, num_full: int) -> None:
        """Extend `req.block_names` to its first `num_full` full blocks (names depend only on the salt and the tokens)."""
        bs = self.block_size
        for i in range(len(req.block_names), num_full):
            parent = req.block_names[i - 1] if i else salt_root(req.options.cache_salt, req.lora_id)
            req.block_names.append(chain_hash(parent, req.token_ids(i * bs, (i + 1) * bs)))
