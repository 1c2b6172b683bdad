"""Recent outputs kept apart by cache salt: a request drafts only from the outputs of requests with its salt (the
prefix cache's, from its API key under `--prefix-cache-scope key`), since a step of several tokens tells its client
which continuation was in the pool. Requests with the same salt (or all unsalted ones) share a pool."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Pool(Protocol[T]):
    def add(self, output: T) -> None: ...

    def remove(self, output: T) -> None:
        """Take back an output added earlier: always the oldest one still held."""


P = TypeVar("P", bound=Pool)


class SaltedPools(Generic[P]):
    """A pool per salt, made with its first output and dropped with its last, under one bound over them all: at most
    `capacity` (in the outputs' sizes) held, the oldest output leaving first whoever's it is. The memory and the order
    of leaving are those of a single pool, so many keys or salts hold no more, nor push out more of others' outputs,
    than as many requests under one key would."""

    def __init__(self, new_pool: Callable[[], P], capacity: int):
        self._new_pool = new_pool
        self.capacity = capacity
        self._pools: dict[bytes, P] = {}
        self._counts: dict[bytes, int] = {}  # outputs each pool holds
        self._order: deque[tuple[bytes, object, int]] = deque()  # (salt, output, size) of those held, oldest first
        self.size = 0  # the sizes of the outputs held, all salts together

    def add(self, salt: bytes, output: object, size: int) -> None:
        pool = self._pools.get(salt)
        if pool is None:
            pool = self._pools[salt] = self._new_pool()
        pool.add(output)
        self._counts[salt] = self._counts.get(salt, 0) + 1
        self._order.append((salt, output, size))
        self.size += size
        while self.size > self.capacity:
            old, old_output, old_size = self._order.popleft()
            self.size -= old_size
            self._pools[old].remove(old_output)
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._pools[old], self._counts[old]

    def get(self, salt: bytes) -> P | None:
        return self._pools.get(salt)

    def pools(self) -> list[P]:
        return list(self._pools.values())
