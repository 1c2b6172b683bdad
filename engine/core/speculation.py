"""Speculative decoding's policy (issue 30): which decoding requests get draft tokens this step, and how many.

A draft token costs a row of the step whether the target accepts it or not, and the d-th counts only if all before
it were accepted. Each request keeps an estimate `acceptance` of the chance that its next draft token is accepted
(an average over its recent draft tokens), so its d-th draft token pays with probability acceptance ** d; a draft
grows while that stays at or above `min_gain`. A request whose drafts keep failing thus stops drafting, and probes
again with one token once its estimate has recovered. The engine stops drafting altogether while more than
`max_batch` requests decode: a step's rows then cost compute, and verification would cost more than it saves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.core.request import Request


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the request's whole context, which only grows)."""


class DraftSource(Protocol):
    """Makes each request's drafter (engine/spec/sources.py) and learns from finished outputs."""

    def new_drafter(self) -> Drafter: ...

    def finished(self, output_token_ids: Sequence[int]) -> None: ...


@dataclass
class RequestSpeculation:
    """One request's drafter and what its drafts have earned so far."""

    drafter: Drafter
    acceptance: float  # estimated chance that its next draft token is accepted
    num_drafted: int = 0
    num_accepted: int = 0


class Speculation:
    """Hands out drafts at schedule time and learns from each step's verification."""

    PRIOR = 0.8  # a new request's acceptance estimate: it drafts a few tokens before it knows better
    WEIGHT = 0.2  # how much each draft token's outcome moves the estimate
    RECOVERY = 0.05  # how far a request that does not draft moves back toward PRIOR per step

    def __init__(self, source: DraftSource, max_tokens: int, max_batch: int, min_gain: float = 0.3):
        self.source = source
        self.max_tokens = max_tokens  # most draft tokens per request per step
        self.max_batch = max_batch  # most decoding requests at which the engine still drafts
        self.min_gain = min_gain
        self.num_drafted = 0  # draft tokens sent to verification, since start
        self.num_accepted = 0  # of those, accepted
        self.accepted_lengths: list[int] = []  # per verified draft since the last drain: tokens accepted

    def draft(self, req: Request, limit: int, num_decoding: int) -> list[int]:
        """Draft tokens for `req`'s next step: at most `limit` (what its max_tokens, the context window and the
        step's token budget leave), none while more than `max_batch` requests decode."""
        state = req.speculation
        if state is None:
            state = req.speculation = RequestSpeculation(self.source.new_drafter(), self.PRIOR)
        if num_decoding > self.max_batch or limit <= 0:
            return []
        k = min(limit, self.max_tokens, self._worth_drafting(state.acceptance))
        if k <= 0:  # not worth a row: recover slowly, to probe again with one token
            state.acceptance = min(self.PRIOR, state.acceptance + self.RECOVERY)
            return []
        return state.drafter.propose(req.prompt_token_ids + req.output_token_ids, k)

    def _worth_drafting(self, acceptance: float) -> int:
        """The longest draft whose last token is accepted with probability min_gain or more."""
        if acceptance >= 1.0:
            return self.max_tokens
        if acceptance <= 0.0:
            return 0
        return int(math.log(self.min_gain) / math.log(acceptance) + 1e-9)

    def verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """The target accepted the first `num_accepted` of the request's `num_drafted` draft tokens."""
        state = req.speculation
        if state is None or not num_drafted:
            return
        state.num_drafted += num_drafted
        state.num_accepted += num_accepted
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.accepted_lengths.append(num_accepted)
        for outcome in [1.0] * num_accepted + [0.0] * (num_accepted < num_drafted):
            state.acceptance += self.WEIGHT * (outcome - state.acceptance)

    def finished(self, req: Request) -> None:
        if req.speculation is not None:
            self.source.finished(req.output_token_ids)

    def drain_accepted_lengths(self) -> list[int]:
        lengths, self.accepted_lengths = self.accepted_lengths, []
        return lengths
