"""Speculative decoding's policy (issue 30): which decoding requests get draft tokens this step, and how many.

A draft token costs a row of the step whether the target accepts it or not, and the d-th counts only if all before
it were accepted. Each request keeps an estimate `acceptance` of the chance that its next draft token is accepted
(an average over its recent draft tokens), so k draft tokens yield 1 + a + ... + a ** k tokens, expected (the 1: the
token the step samples after them).

A request drafts the k that makes the most tokens a second of the step: the requests scheduled before it bring
their rows and expected tokens (a row and a token each, plus their drafts), and it adds 1 + a + ... + a ** k tokens
for k more rows. What a step of R rows costs is measured (StepCost: a line whose slope is fitted to consecutive
decode steps), so a device whose rows are nearly free (a GPU's decode) drafts beside many requests, while alone on
the CPU (a row ~0.1-0.3 of a step) a request drafts several tokens at 0.8 acceptance and beside 31 others only what
is near certain. A request whose drafts keep failing stops drafting, and probes again with one token once its
estimate has recovered.
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
    """Makes each request's drafters (engine/spec/sources.py) and learns from finished outputs."""

    def new_drafters(self) -> list[Drafter]:
        """A request's drafters, tried in order: the first with a proposal drafts, judged by its own record."""

    def finished(self, output_token_ids: Sequence[int]) -> None: ...


@dataclass
class RequestSpeculation:
    """One request's drafters and what each one's drafts have earned so far (its own context's matches and other
    requests' outputs are accepted at different rates)."""

    drafters: list[Drafter]
    acceptance: list[float]  # per drafter: estimated chance that its next draft token is accepted
    drafting: int = 0  # the drafter whose draft was scheduled last: verification's outcome is its
    num_drafted: int = 0
    num_accepted: int = 0


@dataclass
class StepDrafts:
    """A step being scheduled, as its decoding requests draft one by one: its rows so far and the tokens they should
    yield (each request's own row a token, a draft token its chance of being accepted)."""

    rows: int
    tokens: float


class StepCost:
    """What a decode step costs by its rows, from the engine's own steps: a line through the level of the recent
    steps (their rows and seconds) whose slope, one more row's seconds, is fitted to the differences between
    consecutive steps (which a shared machine's slow swings in speed hardly move) and starts at the prior 1 + PRIOR R,
    which only steps that differ in rows move. A row cost set in the config fixes the line at 1 + r R."""

    PRIOR = 0.25  # the CPU here: 0.8 ms a row on a 6.5 ms step of one row (benchmarks/README.md)
    PRIOR_PAIRS = 20.0  # the prior slope weighs as much as this many pairs of consecutive steps one row apart
    MEMORY = 0.99  # each pair's weight in the slope decays by this at every later step: about the last 100 count
    LEVEL = 0.1  # how far each step moves the level (rows and seconds) the line goes through
    CLIP = 4.0  # a pair counts at most this many typical deviations off the line: a hiccup is not a row's cost
    BOUNDS = (0.01, 4.0)  # r, one more row's share of a step's fixed cost: from nearly free (a GPU) to all the cost

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.level: tuple[float, float] | None = None  # recent decode steps' rows and seconds
        self.last: tuple[int, float] | None = None  # the latest step's rows and seconds
        self.sxx = self.sxy = 0.0  # decayed sums over pairs of consecutive steps: rows' and seconds' differences
        self.deviation = 0.0  # a pair's typical distance off the line, in seconds

    def observe(self, rows: int, seconds: float) -> None:
        if self.level is None:
            self.level = (float(rows), seconds)
        else:
            level_rows, level_seconds = self.level
            self.level = (level_rows + self.LEVEL * (rows - level_rows),
                          level_seconds + self.LEVEL * (seconds - level_seconds))
        if self.last is not None:
            dx, dy = rows - self.last[0], seconds - self.last[1]
            slope = self.slope()
            off = dy - slope * dx
            limit = self.CLIP * (self.deviation or 0.05 * self.level[1])
            off = max(-limit, min(limit, off))
            self.deviation += 0.05 * (abs(off) - self.deviation)
            self.sxx = self.MEMORY * self.sxx + dx * dx
            self.sxy = self.MEMORY * self.sxy + dx * (slope * dx + off)
        self.last = (rows, seconds)

    def slope(self) -> float:
        """One more row's seconds: the pairs' least-squares slope, drawn toward the prior's (and never below a GPU's)."""
        level_rows, level_seconds = self.level
        low, _ = self.BOUNDS
        prior = level_seconds * self.PRIOR / (1 + self.PRIOR * level_rows)
        fitted = (self.sxy + self.PRIOR_PAIRS * prior) / (self.sxx + self.PRIOR_PAIRS)
        return max(fitted, level_seconds * low / (1 + low * level_rows))

    @property
    def value(self) -> float:
        """One more row's cost as a share of a step's fixed cost (r), as metrics show it."""
        if self.fixed is not None:
            return self.fixed
        if self.level is None:
            return self.PRIOR
        slope = self.slope()
        fixed = self.level[1] - slope * self.level[0]
        low, high = self.BOUNDS
        return high if fixed <= slope / high else max(low, slope / fixed)

    def costs(self, rows: range) -> list[float]:
        """A step of each of `rows` rows, in seconds (in units of a step's fixed cost while nothing is measured)."""
        if self.fixed is not None or self.level is None:
            r = self.PRIOR if self.fixed is None else self.fixed
            return [1 + r * n for n in rows]
        level_rows, level_seconds = self.level
        slope = self.slope()
        floor = 0.01 * level_seconds  # a line extrapolated far below the steps seen must still cost something
        return [max(floor, level_seconds + slope * (n - level_rows)) for n in rows]


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
        # A new request's acceptance estimates, per drafter: recent draft tokens' outcomes, all requests' (open chat
        # accepts fewer than a rewrite of its prompt, and a request starting out optimistic pays for it in rows).
        self.priors: list[float] = []
        self.num_drafted = 0  # draft tokens sent to verification, since start
        self.num_accepted = 0  # of those, accepted
        self.accepted_lengths: list[int] = []  # per verified draft since the last drain: tokens accepted

    def new_step(self, num_decoding: int) -> StepDrafts:
        """A step about to schedule `num_decoding` requests' next tokens, before any drafts."""
        return StepDrafts(num_decoding, float(num_decoding))

    def draft(self, req: Request, limit: int, step: StepDrafts) -> list[int]:
        """Draft tokens for `req`'s next step, beside the rows `step` holds so far: at most `limit` (what its
        max_tokens, the context window and the step's token budget leave), and only as many as pay for their rows.
        Once they are scheduled (their blocks allocated), `join` counts them in the step."""
        state = req.speculation
        if state is None:
            drafters = self.source.new_drafters()
            self.priors += [self.PRIOR] * (len(drafters) - len(self.priors))
            state = req.speculation = RequestSpeculation(drafters, self.priors[:len(drafters)])
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return []
        context = req.prompt_token_ids + req.output_token_ids
        for i, drafter in enumerate(state.drafters):
            draft = drafter.propose(context, limit)
            if draft:
                break
        else:
            return []
        k = self._worth_drafting(state.acceptance[i], step)
        if k <= 0:  # not worth a row: recover slowly, to probe again with one token
            a = state.acceptance[i]
            state.acceptance[i] = min(max(self.priors[i], a), a + self.RECOVERY)
            return []
        state.drafting = i
        return draft[:k]

    def join(self, req: Request, draft: list[int], step: StepDrafts) -> None:
        """Count `req`'s scheduled draft in its step: a row each, and the tokens they should yield."""
        step.rows += len(draft)
        state = req.speculation
        step.tokens += sum(state.acceptance[state.drafting] ** d for d in range(1, len(draft) + 1))

    def _worth_drafting(self, acceptance: float, step: StepDrafts) -> int:
        """The draft length that makes the step the most tokens a second (see the module's docstring)."""
        costs = self.step_cost.costs(range(step.rows, step.rows + 1 + self.max_tokens))
        tokens = step.tokens
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
        i = state.drafting
        for outcome in [1.0] * num_accepted + [0.0] * (num_accepted < num_drafted):
            state.acceptance[i] += self.WEIGHT * (outcome - state.acceptance[i])
            self.priors[i] += self.PRIOR_WEIGHT * (outcome - self.priors[i])

    def finished(self, req: Request) -> None:
        if req.speculation is not None:
            self.source.finished(req.output_token_ids)

    def drain_accepted_lengths(self) -> list[int]:
        lengths, self.accepted_lengths = self.accepted_lengths, []
        return lengths
