"""What the engine asks for a request's drafters: one source per method, named by `--speculative`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.drafting.ngram import NgramDrafter, RecentNgrams, SaltedNgrams
from engine.drafting.suffix_tree import RecentOutputs, SuffixDrafter


class NgramSource:
    """Prompt lookup: each request drafts from its own context, and where that has no match, from the n-grams of
    recent outputs of the requests with its cache salt (each judged by its own acceptance)."""

    # Matches of up to 8 tokens: on copy-heavy answers longer matches draft more accepted tokens in fewer steps than
    # n <= 4 did; recent outputs' matches of up to 4 draft as well as up to 8 (docs/performance.md, Speculative).
    def __init__(
        self, shared: bool = True, min_n: int = 2, max_n: int = 8, shared_max_n: int = 4, shared_capacity: int = 32768
    ):
        self.min_n, self.max_n = min_n, max_n
        self.recent = RecentNgrams(min_n, shared_max_n, shared_capacity) if shared else None

    def new_drafters(self, salt: bytes = b"") -> list[NgramDrafter | SaltedNgrams]:
        own = NgramDrafter(self.min_n, self.max_n)
        return [own] if self.recent is None else [own, self.recent.drafter(salt)]

    def finished(self, output_token_ids: Sequence[int], salt: bytes = b"") -> None:
        if self.recent is not None:
            self.recent.add(output_token_ids, salt)


class SuffixSource:
    """Suffix trees: each request's own context, and (`shared`) a tree per cache salt over the recent outputs of the
    requests with that salt, the last `capacity` outputs of all salts together."""

    def __init__(self, shared: bool = True, capacity: int = 256, depth: int = 24):
        self.depth = depth
        self.recent = RecentOutputs(depth, capacity) if shared else None

    def new_drafters(self, salt: bytes = b"") -> list[SuffixDrafter]:
        return [SuffixDrafter(self.recent, salt, self.depth)]

    def finished(self, output_token_ids: Sequence[int], salt: bytes = b"") -> None:
        if self.recent is not None:
            self.recent.add(output_token_ids, salt)


DRAFT_SOURCES = {"ngram": NgramSource, "suffix": SuffixSource}
