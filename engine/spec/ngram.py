"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's last n tokens."""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafter:
    """One request's drafter. For n from `max_n` down to `min_n`, the last n tokens are looked up among the n-grams
    that end earlier in the context (prompt and output); the first n that matches wins, and its latest occurrence's
    next tokens are the draft. An index of each n-gram's latest end grows with the context, so a call costs
    O(max_n) per new token, not a scan of the context."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._latest_end: dict[tuple[int, ...], int] = {}  # an n-gram -> where its latest indexed occurrence ends
        self._indexed = 0  # n-grams ending at or before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the request's whole context so far, which only grows)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        # Index the n-grams that end before the last token: the context's own suffix must not match itself.
        for end in range(max(self._indexed + 1, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._latest_end[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._latest_end.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return list(tokens[end:end + k])
        return []
