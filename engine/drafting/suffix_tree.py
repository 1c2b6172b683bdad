"""Suffix trees of bounded depth: how often each short substring of a context occurred, and what followed it.

SuffixDecoding (Oliaro et al., 2024) drafts from suffix trees over the request's own context and over recent
outputs of other requests: find the longest suffix of the context that occurred before, then follow the most
frequent continuation for as long as it stays likely. The draft's length varies with the evidence: a long match
followed the same way every time drafts far, a short or disputed one little or nothing.

A tree here holds every substring of up to `depth` tokens of the sequences added to it, each node counting the
occurrences of its path, so a token appended to a sequence updates `depth` nodes (the suffixes it extends).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.drafting.pools import SaltedPools


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path from the root to here
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counts of every substring of up to `depth` tokens of the sequences added (and not yet removed)."""

    def __init__(self, depth: int = 24):
        if depth < 2:
            raise ValueError(f"a suffix tree needs a depth of at least 2, not {depth}")
        self.depth = depth
        self.root = _Node()

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence whose suffixes (shortest first, depth - 1 at most) end at `active`'s
        nodes; returns the new suffixes' nodes. Start a sequence with `active=[]`."""
        grown = []
        for node in [self.root, *active]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            grown.append(child)
        return grown[: self.depth - 1]

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of `tokens` (up to the depth)."""
        active: list[_Node] = []
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back an earlier `add(tokens)`: its counts go, and the nodes only it made."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def match(self, tokens: Sequence[int]) -> tuple[int, _Node | None]:
        """The longest suffix of `tokens` (shorter than the depth) whose path exists and has a continuation:
        its length and its node; (0, None) if none has."""
        for n in range(min(self.depth - 1, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - n :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return n, node
        return 0, None

    def num_nodes(self) -> int:
        stack, n = [self.root], 0
        while stack:
            node = stack.pop()
            n += len(node.children)
            stack.extend(node.children.values())
        return n


def follow(node: _Node, k: int, min_probability: float) -> tuple[list[int], float]:
    """From a matched node, the most frequent continuation (ties to the smaller token id) while the product of each
    step's share of its parent's continuations stays at or above `min_probability`, up to k tokens; and the draft's
    expected number of accepted tokens under those shares (the sum of the running products)."""
    draft: list[int] = []
    probability, expected = 1.0, 0.0
    while len(draft) < k and node.children:
        token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
        probability *= child.count / sum(c.count for c in node.children.values())
        if probability < min_probability:
            break
        draft.append(token)
        expected += probability
        node = child
    return draft, expected


class SuffixDrafter:
    """One request's drafter: a tree over its own context, grown as the context grows, and optionally the tree over
    the recent outputs of requests with its cache salt (`recent`, `salt`); the draft with more expected accepted
    tokens wins. A draft is at most `max_spec_factor` times the matched suffix's length (a one-token match drafts
    little)."""

    def __init__(
        self,
        recent: RecentOutputs | None = None,
        salt: bytes = b"",
        depth: int = 24,
        min_probability: float = 0.1,
        max_spec_factor: float = 1.0,
    ):
        self.own = SuffixTree(depth)
        self.recent, self.salt = recent, salt
        self.min_probability = min_probability
        self.max_spec_factor = max_spec_factor
        self._active: list[_Node] = []
        self._seen = 0  # tokens of the context already in `own`
        self.matched = 0  # the context suffix the latest proposal matched, in tokens (0: none)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the request's whole context so far, which only grows)."""
        for t in tokens[self._seen :]:
            self._active = self.own.extend(self._active, t)
        self._seen = len(tokens)
        if k <= 0:
            return []
        # The own tree's suffix nodes are at hand (the i-th is the suffix of i + 1 tokens): the longest with a
        # continuation is the longest that occurred before.
        own = next(((i + 1, node) for i, node in reversed(list(enumerate(self._active))) if node.children), (0, None))
        best: tuple[float, list[int], int] = (0.0, [], 0)
        # Looked up at each proposal: the salt's tree goes with its last output, and a new one comes with the next.
        shared = self.recent.tree(self.salt) if self.recent is not None else None
        for n, node in (own, shared.match(tokens) if shared is not None else (0, None)):
            if node is None:
                continue
            limit = min(k, max(1, int(self.max_spec_factor * n)))
            draft, expected = follow(node, limit, self.min_probability)
            if expected > best[0]:
                best = (expected, draft, n)
        _, draft, self.matched = best
        return draft


class RecentOutputs:
    """The last `capacity` finished outputs (all salts together), in a tree per cache salt (engine/drafting/pools.py);
    the oldest is taken back as a new one comes."""

    def __init__(self, depth: int = 24, capacity: int = 256):
        self.capacity = capacity
        self._trees = SaltedPools(lambda: SuffixTree(depth), capacity)

    def add(self, output: Sequence[int], salt: bytes = b"") -> None:
        self._trees.add(salt, tuple(output), 1)

    def tree(self, salt: bytes = b"") -> SuffixTree | None:
        """The tree over the recent outputs of requests with `salt`; None while they have none."""
        return self._trees.get(salt)
