"""Speculative decoding's policy (issue 30): which decoding requests get draft tokens this step, and how many.

A draft token costs a row of the step whether the target accepts it or not, and the d-th counts only if all before
it were accepted. Each request keeps an estimate `acceptance` of the chance that its next draft token is accepted
(an average over its recent draft tokens), so k draft tokens yield 1 + a + ... + a ** k tokens, expected (the 1: the
token the step samples after them).

A request drafts the k that makes the most tokens a second: beside B - 1 others (a row and a token each), the step's
B - 1 + 1 + a + ... + a ** k tokens over what a step of B + k rows costs. What a step costs by its rows is measured
(StepCost, from the engine's own decode steps), so a device whose rows are nearly free (a GPU's decode) drafts beside
many requests, while alone on the CPU (a row ~0.2-0.3 of a step) a request drafts ~4 tokens at 0.8 acceptance and
beside 31 others only what is near certain. The measured cost keeps the shape of the CPU's kernels, which multiply 12
rows per pass over the weights (8 on AVX2), and a row that starts a new pass costs more than one inside a pass, so a
draft stops short of a new pass unless its tokens pay for the pass. A request whose drafts keep failing stops
drafting, and probes again with one token once its estimate has recovered.
"""

from __future__ import annotations

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


class StepCost:
    """What a decode step of R rows costs, from the engine's own steps: the average of recent steps of R rows where
    there have been enough of them, else the line a + b R fitted by least squares over recent steps (older ones
    forgotten geometrically); the line's r = b / a (one more row's share of a step) is what metrics show. Until the
    steps seen are enough and vary enough in rows to say, 1 + PRIOR R; a row cost set in the config is that line."""

    PRIOR = 0.25  # the CPU here: 1.2-1.4 ms a row on a 5-6 ms step
    MEMORY = 0.99  # each step's weight in the line decays by this at every later step: about the last 100 count
    MIN_WEIGHT = 30.0  # steps (weighted) before the line counts
    MIN_SPREAD = 1.0  # rows' standard deviation over those steps before the line counts
    BOUNDS = (0.01, 4.0)  # what the line may say of r: from rows nearly free (a GPU's decode) to rows all the cost
    AVERAGE = 0.1  # how much a step moves the average of its row count
    MIN_SEEN = 5  # steps of a row count before their average stands for it

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, rows, seconds, rows^2, rows * seconds
        self.by_rows: dict[int, tuple[int, float]] = {}  # rows -> steps seen, their average seconds

    def observe(self, rows: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * self.MEMORY for v in self.sums)
        self.sums = (w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds)
        seen, average = self.by_rows.get(rows, (0, seconds))
        self.by_rows[rows] = (seen + 1, average + self.AVERAGE * (seconds - average))

    def _line(self) -> tuple[float, float] | None:
        """(a, r): a step of R rows takes a (1 + r R) seconds; None while the steps cannot tell."""
        w, x, y, xx, xy = self.sums
        if w < self.MIN_WEIGHT:
            return None
        mean_x, mean_y = x / w, y / w
        spread = xx / w - mean_x * mean_x
        if spread < self.MIN_SPREAD**2:
            return None
        b = (xy / w - mean_x * mean_y) / spread
        a = mean_y - b * mean_x
        low, high = self.BOUNDS
        return (a, min(high, max(low, b / a))) if a > 0 else None

    @property
    def value(self) -> float:
        """One more row's cost as a share of a step's fixed cost (r)."""
        if self.fixed is not None:
            return self.fixed
        line = self._line()
        return self.PRIOR if line is None else line[1]

    def costs(self, rows: range) -> list[float]:
        """A step of each of `rows` rows, in seconds (in units of a step's fixed cost while nothing is measured)."""
        if self.fixed is not None:
            return [1 + self.fixed * n for n in rows]
        line = self._line()  # once for all of them: it is a least-squares solve
        if line is None:
            return [1 + self.PRIOR * n for n in rows]
        a, r = line

        def cost(n: int) -> float:
            seen, average = self.by_rows.get(n, (0, 0.0))
            return average if seen >= self.MIN_SEEN else a * (1 + r * n)

        return [cost(n) for n in rows]


class Speculation:
    """Hands out drafts at schedule time and learns from each step's verification."""

    PRIOR = 0.8  # the first request's acceptance estimate: it drafts a few tokens before it knows better
    PRIOR_WEIGHT = 0.01  # how much each draft token's outcome, any request's, moves a new request's estimate
    WEIGHT = 0.2  # how much each draft token's outcome moves the request's own estimate
    RECOVERY = 0.05  # how far a request that does not draft moves back toward a new request's estimate per step

    def __init__(self, source: DraftSource, max_tokens: int, row_cost: float | None = None):
        self.source = source
        self.max_tokens = max_tokens  # most draft tokens per request per step
        self.step_cost = StepCost(row_cost)  # a step's cost by its rows (row_cost: a fixed share of a step a row)
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
        """The draft length that makes the most tokens a second (see the module's docstring)."""
        others = max(1, num_decoding) - 1
        costs = self.step_cost.costs(range(others + 1, others + 2 + self.max_tokens))
        tokens = others + 1.0
        best, best_rate = 0, tokens / costs[0]
        gain = 1.0
        for k in range(1, self.max_tokens + 1):
            gain *= acceptance
            tokens += gain
            rate = tokens / costs[k]
            if rate > best_rate:
                best, best_rate = k, rate
        return best

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
