"""Speculative decoding's drafts without a second model (issue 30): a drafter per request proposes the tokens that
followed earlier occurrences of the request's latest tokens, for the target model to verify in one step.

Pure Python over token ids, run on the host while the device computes: imports nothing else of the engine, and no
torch. `ngram.py` is prompt lookup (the longest recent n-gram match, in the request's context or else in recent
outputs); `suffix_tree.py` counts every context's substrings up to a depth, per request and across recent outputs,
and drafts by frequency (SuffixDecoding, 2024); recent outputs are kept apart by cache salt (`pools.py`), so a
request drafts only from those of requests with its salt; `sources.py` makes each request's drafters for the
engine (engine/core/speculation.py decides how far it drafts).
"""

from engine.drafting.ngram import NgramDrafter, RecentNgrams, SaltedNgrams
from engine.drafting.sources import DRAFT_SOURCES, NgramSource, SuffixSource
from engine.drafting.suffix_tree import RecentOutputs, SuffixDrafter, SuffixTree

__all__ = [
    "DRAFT_SOURCES",
    "NgramDrafter",
    "NgramSource",
    "RecentNgrams",
    "RecentOutputs",
    "SaltedNgrams",
    "SuffixDrafter",
    "SuffixSource",
    "SuffixTree",
]
