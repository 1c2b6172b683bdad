"""Speculative decoding's policy (issue 30): which decoding requests get draft tokens this step, and how many.

A draft token costs a row of the step whether the target accepts it or not, and the d-th counts only if all before
it were accepted. Each request keeps an estimate `acceptance` of the chance that its next draft token is accepted
(an average over its recent draft tokens), so its d-th draft token yields acceptance ** d tokens, expected.

What a row costs: a step of R rows takes about T0 * (1 + row_cost * R), so with B requests decoding a step makes
B / (T0 * (1 + row_cost * B)) tokens per unit of time, and one more row (row_cost * T0) pays while it yields at
least row_cost * B / (1 + row_cost * B) tokens: a draft grows while acceptance ** d stays above that. The row cost is
measured (RowCost: fitted to the engine's own decode steps), so a device whose rows are nearly free (a GPU's decode)
drafts beside many requests. Alone on the CPU (row_cost 0.12-0.25 measured: about a millisecond a row on a 5-6 ms
step) a draft token must be accepted one time in five to nine; beside 31 others (0.25), nine times in ten, so a busy
engine drafts only what is near certain. A request whose drafts keep failing stops drafting, and probes again with
one token once its estimate has recovered.
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


class RowCost:
    """One more row's cost as a share of a step's fixed cost, fitted to the engine's decode steps: seconds = a + b rows
    by least squares over recent steps (older ones forgotten geometrically), r = b / a. PRIOR until the steps seen
    are enough and vary enough in rows to say; a value set in the config is used as it is."""

    PRIOR = 0.25  # the CPU here: 1.2-1.4 ms a row on a 5-6 ms step
    MEMORY = 0.99  # each step's weight decays by this at every later step: about the last 100 count
    MIN_WEIGHT = 30.0  # steps (weighted) before the fit counts
    MIN_SPREAD = 1.0  # rows' standard deviation over those steps before the fit counts
    BOUNDS = (0.01, 4.0)  # what a fit may say: from rows nearly free (a GPU's decode) to rows all the cost

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, rows, seconds, rows^2, rows * seconds

    def observe(self, rows: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * self.MEMORY for v in self.sums)
        self.sums = (w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds)

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        w, x, y, xx, xy = self.sums
        if w < self.MIN_WEIGHT:
            return self.PRIOR
        mean_x, mean_y = x / w, y / w
        spread = xx / w - mean_x * mean_x
        if spread < self.MIN_SPREAD**2:
            return self.PRIOR
        b = (xy / w - mean_x * mean_y) / spread
        a = mean_y - b * mean_x
        low, high = self.BOUNDS
        return high if a <= 0 else min(high, max(low, b / a))


class Speculation:
    """Hands out drafts at schedule time and learns from each step's verification."""

    PRIOR = 0.8  # the first request's acceptance estimate: it drafts a few tokens before it knows better
    PRIOR_WEIGHT = 0.01  # how much each draft token's outcome, any request's, moves a new request's estimate
    WEIGHT = 0.2  # how much each draft token's outcome moves the request's own estimate
    RECOVERY = 0.05  # how far a request that does not draft moves back toward a new request's estimate per step

    def __init__(self, source: DraftSource, max_tokens: int, row_cost: float | None = None):
        self.source = source
        self.max_tokens = max_tokens  # most draft tokens per request per step
        self.row_cost = RowCost(row_cost)  # one more row's cost, as a share of a step's fixed cost (None: measured)
        # A new request's acceptance estimate: recent draft tokens' outcomes, all requests' (open chat accepts fewer
        # than a rewrite of its prompt, and a request starting out optimistic pays for it in rows).
        self.prior = self.PRIOR
        self.num_drafted = 0  # draft tokens sent to verification, since start
        self.num_accepted = 0  # of those, accepted
        self.accepted_lengths: list[int] = []  # per verified draft since the last drain: tokens accepted

    def draft(self, req: Request, limit: int, num_decoding: int) -> list[int]:
        """Draft tokens for `req`'s next step, beside `num_decoding` requests: at most `limit` (what its max_tokens, the
        context window and the step's token budget leave), and only as many as pay for their rows."""
        state = req.speculation
        if state is None:
            state = req.speculation = RequestSpeculation(self.source.new_drafter(), self.prior)
        if limit <= 0:
            return []
        k = min(limit, self.max_tokens, self._worth_drafting(state.acceptance, num_decoding))
        if k <= 0:  # not worth a row: recover slowly, to probe again with one token
            state.acceptance = min(max(self.prior, state.acceptance), state.acceptance + self.RECOVERY)
            return []
        return state.drafter.propose(req.prompt_token_ids + req.output_token_ids, k)

    def _worth_drafting(self, acceptance: float, num_decoding: int) -> int:
        """The longest draft whose last token pays for its row (see the module's docstring)."""
        cost = self.row_cost.value * max(1, num_decoding)
        min_gain = cost / (1 + cost)
        if acceptance >= 1.0 or min_gain <= 0.0:
            return self.max_tokens
        if acceptance <= min_gain:
            return 0
        return int(math.log(min_gain) / math.log(acceptance) + 1e-9)

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
            self.prior += self.PRIOR_WEIGHT * (outcome - self.prior)

    def finished(self, req: Request) -> None:
        if req.speculation is not None:
            self.source.finished(req.output_token_ids)

    def drain_accepted_lengths(self) -> list[int]:
        lengths, self.accepted_lengths = self.accepted_lengths, []
        return lengths
