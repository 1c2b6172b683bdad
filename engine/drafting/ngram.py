"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's last n tokens, in
the request's own context (NgramDrafter) or in the recent outputs of requests with its cache salt (RecentNgrams)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from engine.drafting.pools import SaltedPools


def _check_sizes(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")


def _ngrams_ending(
    tokens: Sequence[int], ends: Iterable[int], min_n: int, max_n: int
) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, end) for every n-gram of `min_n` to `max_n` tokens of `tokens` that ends at one of `ends`."""
    for end in ends:
        for n in range(min_n, min(max_n, end) + 1):
            yield tuple(tokens[end - n : end]), end


def _longest_suffix(index: dict, tokens: Sequence[int], min_n: int, max_n: int):
    """`index`'s value for the longest n-gram (`max_n` tokens down to `min_n`) that ends `tokens`, and its n;
    (None, 0) if none."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        value = index.get(tuple(tokens[len(tokens) - n :]))
        if value is not None:
            return value, n
    return None, 0


class _OutputNgrams:
    """One salt's recent outputs' n-grams, each pointing at its latest occurrence; an output's n-grams leave with it
    unless a later output has them too."""

    __slots__ = ("latest", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], tuple[int, tuple[int, ...], int]] = {}  # n-gram -> (serial, output, end)

    def _ngrams(self, output: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int]]:
        # Only n-grams with a token after them: a draft needs a continuation.
        return _ngrams_ending(output, range(self.min_n, len(output)), self.min_n, self.max_n)

    def add(self, numbered: tuple[int, tuple[int, ...]]) -> None:
        serial, output = numbered
        for ngram, end in self._ngrams(output):
            self.latest[ngram] = (serial, output, end)

    def remove(self, numbered: tuple[int, tuple[int, ...]]) -> None:
        serial, output = numbered
        for ngram, _ in self._ngrams(output):
            entry = self.latest.get(ngram)
            if entry is not None and entry[0] == serial:
                del self.latest[ngram]


class RecentNgrams:
    """The n-grams of the latest finished outputs (at most `capacity` tokens of them, all salts together), apart per
    cache salt (engine/drafting/pools.py). Shared by the requests of a salt as a drafter (`drafter`): answers to similar
    requests share their structure (a JSON record's keys, a docstring's sections, a list's phrasing), which a
    request's own context holds only from its second occurrence on."""

    # An output's first tokens only: indexing (and forgetting as many older tokens) runs in the engine's step loop at
    # a cost per token, and a long answer indexed whole would stall every running request for several steps.
    MAX_OUTPUT_TOKENS = 4096

    def __init__(self, min_n: int = 2, max_n: int = 4, capacity: int = 32768):
        _check_sizes(min_n, max_n)
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self._pools = SaltedPools(lambda: _OutputNgrams(min_n, max_n), capacity)
        self._serial = 0  # outputs added: numbers them, so one leaving takes only the n-grams that still point at it
        self.matched = 0  # the context suffix the latest proposal matched, in tokens (0: none)

    def add(self, output: Sequence[int], salt: bytes = b"") -> None:
        tokens = tuple(output[: min(self.capacity, self.MAX_OUTPUT_TOKENS)])
        if tokens:  # an empty one has no n-gram, and outputs of no size would pile up under the bound
            self._serial += 1
            self._pools.add(salt, (self._serial, tokens), len(tokens))

    def propose(self, tokens: Sequence[int], k: int, salt: bytes = b"") -> list[int]:
        """Up to k tokens that followed the longest of the context's last n-grams in a recent output of `salt`'s."""
        pool = self._pools.get(salt)
        if pool is None:
            self.matched = 0
            return []
        entry, self.matched = _longest_suffix(pool.latest, tokens, self.min_n, self.max_n)
        if entry is None:
            return []
        _, output, end = entry
        return list(output[end : end + k])

    def drafter(self, salt: bytes = b"") -> SaltedNgrams:
        return SaltedNgrams(self, salt)

    def __len__(self) -> int:
        return sum(len(pool.latest) for pool in self._pools.pools())


class SaltedNgrams:
    """A request's drafter over the recent outputs of the requests with its salt."""

    def __init__(self, recent: RecentNgrams, salt: bytes):
        self.recent, self.salt = recent, salt
        self.matched = 0  # the context suffix the latest proposal matched, in tokens (0: none)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        draft = self.recent.propose(tokens, k, self.salt)
        self.matched = self.recent.matched
        return draft


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
        return [] if end is None else list(tokens[end : end + k])
