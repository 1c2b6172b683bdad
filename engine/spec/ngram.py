"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's last n tokens, in
the request's own context (NgramDrafter) or in other requests' recent outputs (RecentNgrams)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence


def _check_sizes(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")


def _ngrams_ending(tokens: Sequence[int], ends: Iterable[int], min_n: int, max_n: int
                   ) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, end) for every n-gram of `min_n` to `max_n` tokens of `tokens` that ends at one of `ends`."""
    for end in ends:
        for n in range(min_n, min(max_n, end) + 1):
            yield tuple(tokens[end - n:end]), end


def _longest_suffix(index: dict, tokens: Sequence[int], min_n: int, max_n: int):
    """`index`'s value for the longest n-gram (`max_n` tokens down to `min_n`) that ends `tokens`, and its n;
    (None, 0) if none."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        value = index.get(tuple(tokens[len(tokens) - n:]))
        if value is not None:
            return value, n
    return None, 0


class RecentNgrams:
    """The n-grams of the latest finished outputs (at most `capacity` tokens of them), each pointing at its latest
    occurrence; an output's n-grams leave with it unless a later output has them too. One is shared by all requests
    as a drafter: answers to similar requests share their structure (a JSON record's keys, a docstring's sections, a
    list's phrasing), which a request's own context holds only from its second occurrence on."""

    # An output's first tokens only: indexing (and forgetting as many older tokens) takes ~2.5 us a token here, in the
    # engine's step loop, and a 32k-token answer indexed whole would hold every running request for ~80 ms.
    MAX_OUTPUT_TOKENS = 4096

    def __init__(self, min_n: int = 2, max_n: int = 4, capacity: int = 32768):
        _check_sizes(min_n, max_n)
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self._latest: dict[tuple[int, ...], tuple[int, tuple[int, ...], int]] = {}  # n-gram -> (serial, output, end)
        self._outputs: deque[tuple[int, tuple[int, ...]]] = deque()  # (serial number, tokens), oldest first
        self._num_tokens = 0
        self._serial = 0
        self.matched = 0  # the context suffix the latest proposal matched, in tokens (0: none)

    def _ngrams(self, output: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int]]:
        # Only n-grams with a token after them: a draft needs a continuation.
        return _ngrams_ending(output, range(self.min_n, len(output)), self.min_n, self.max_n)

    def add(self, output: Sequence[int]) -> None:
        tokens = tuple(output[:min(self.capacity, self.MAX_OUTPUT_TOKENS)])
        self._serial += 1
        self._outputs.append((self._serial, tokens))
        self._num_tokens += len(tokens)
        for ngram, end in self._ngrams(tokens):
            self._latest[ngram] = (self._serial, tokens, end)
        while self._num_tokens > self.capacity:
            serial, old = self._outputs.popleft()
            self._num_tokens -= len(old)
            for ngram, _ in self._ngrams(old):
                entry = self._latest.get(ngram)
                if entry is not None and entry[0] == serial:
                    del self._latest[ngram]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest of the context's last n-grams in a recent output."""
        entry, self.matched = _longest_suffix(self._latest, tokens, self.min_n, self.max_n)
        if entry is None:
            return []
        _, output, end = entry
        return list(output[end:end + k])

    def __len__(self) -> int:
        return len(self._latest)


class NgramDrafter:
    """One request's drafter. For n from `max_n` down to `min_n`, the last n tokens are looked up among the n-grams
    that end earlier in the context (prompt and output); the first n that matches wins, and its latest occurrence's
    next tokens are the draft. An index of each n-gram's latest end grows with the context, so a call costs
    O(max_n) per new token, not a scan of the context."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        _check_sizes(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self._latest_end: dict[tuple[int, ...], int] = {}  # an n-gram -> where its latest indexed occurrence ends
        self._indexed = 0  # n-grams ending at or before this position are in the index
        self.matched = 0  # the context suffix the latest proposal matched, in tokens (0: none)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the request's whole context so far, which only grows)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            self.matched = 0
            return []
        # Index the n-grams that end before the last token: the context's own suffix must not match itself.
        ends = range(max(self._indexed + 1, self.min_n), len(tokens))
        self._latest_end.update(_ngrams_ending(tokens, ends, self.min_n, self.max_n))
        self._indexed = max(self._indexed, len(tokens) - 1)
        # At most len - 1 tokens: an indexed n-gram ends before the last token.
        end, self.matched = _longest_suffix(self._latest_end, tokens, self.min_n, min(self.max_n, len(tokens) - 1))
        return [] if end is None else list(tokens[end:end + k])
