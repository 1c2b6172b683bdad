"""Speculative decoding's policy (issue 30): which decoding requests get draft tokens this step, and how many.

A draft token costs a row of the step whether the target accepts it or not, and the d-th counts only if all before
it were accepted. Each request keeps an estimate `acceptance` of the chance that its next draft's first token is
accepted (an average over its recent drafts, per drafter); the chance that the d-th is accepted once the ones
before it were comes from every request's recent drafts of the same kind (DepthAcceptance: a copy that matched a
long suffix, or whose request's last draft was accepted whole, goes on further). So k draft tokens yield
1 + S(1) + ... + S(k) tokens, expected, S(d) the chance that the first d are all accepted (the 1: the token the
step samples after them).

A request drafts the k that makes the most tokens a second of the step: the requests scheduled before it bring
their rows and expected tokens (a row and a token each, plus their drafts), and it adds 1 + S(1) + ... + S(k) tokens
for k more rows. What a step of R rows costs is measured (StepCost: a line whose slope is fitted to consecutive
decode steps), so a device whose rows are nearly free (a GPU's decode) drafts beside many requests, while alone on
the CPU (a row a good share of a step) a request drafts several tokens at 0.8 acceptance and beside 31 others only
what is near certain. A request whose drafts keep failing stops drafting, and probes again with one token once its
estimate has recovered. A request's estimate is taken at what such estimates have been worth (FirstTokenCalibration):
the drafts that clear a high line are the lucky runs' and hold less often than their estimates say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import Request


class Drafter(Protocol):
    matched: int  # the context suffix its latest proposal matched, in tokens (0: none, or it cannot say)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the request's whole context, which only grows)."""


class DraftSource(Protocol):
    """Makes each request's drafters (engine/drafting/sources.py) and learns from finished outputs; a request's drafters
    see only the outputs of requests with its cache salt, so one API key's drafts never show another's answers."""

    def new_drafters(self, salt: bytes) -> list[Drafter]:
        """A request's drafters, tried in order: the first with a proposal drafts, judged by its own record."""

    def finished(self, output_token_ids: Sequence[int], salt: bytes) -> None: ...


# A draft's kind: its drafter, the context suffix it matched (capped), and whether its request's last draft was
# accepted whole (None: no draft yet).
DraftKind = tuple[int, int, bool | None]


@dataclass
class RequestSpeculation:
    """One request's drafters and what each one's drafts have earned so far (its own context's matches and other
    requests' outputs are accepted at different rates)."""

    drafters: list[Drafter]
    acceptance: list[float]  # per drafter: estimated chance that its next draft's first token is accepted
    drafting: int = 0  # the drafter whose draft was scheduled last: verification's outcome is its
    kind: DraftKind | None = None  # the kind of the draft scheduled last
    survival: list[float] = field(default_factory=list)  # S(1..k) of the draft scheduled last
    last_whole: bool | None = None  # whether its last verified draft was accepted whole
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

    PRIOR = 0.25  # a row's share of a one-row step on a CPU, where rows are far from free; the engine's steps take over
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
            self.level = (
                level_rows + self.LEVEL * (rows - level_rows),
                level_seconds + self.LEVEL * (seconds - level_seconds),
            )
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


def _tally(counts: dict, key, accepted: bool, memory: float) -> None:
    """One more outcome in `counts[key]` ([accepted, seen]); past `memory` seen, older outcomes count half."""
    tally = counts.setdefault(key, [0.0, 0.0])
    tally[0] += accepted
    tally[1] += 1
    if tally[1] > memory:
        tally[0] /= 2
        tally[1] /= 2


class DepthAcceptance:
    """The chance that a draft's d-th token (d >= 2) is accepted once the ones before it were, by the draft's kind,
    from all requests' recent drafts: a draft whose first token holds tends to be a copy that goes on, the more so
    after a long match (replayed through the drafters, greedy outputs model more tokens a second than with one
    estimate for every token: docs/performance.md, Speculative)."""

    PRIOR = 0.8  # a kind's second token before any draft of that kind has reached it
    PRIOR_WEIGHT = 4.0  # the prior weighs as much as this many drafts; a deeper token's prior is the one before's
    MEMORY = 1000.0  # past this many drafts reaching a depth, older ones count half: the chances follow the load
    MAX_MATCH = 8  # matches of this many tokens or more are one kind

    def __init__(self):
        self._counts: dict[tuple[DraftKind, int], list[float]] = {}  # (kind, depth) -> [accepted, reached]

    def kind(self, drafter: int, matched: int, last_whole: bool | None) -> DraftKind:
        return drafter, min(matched, self.MAX_MATCH), last_whole

    def survival(self, kind: DraftKind, first: float, k: int) -> list[float]:
        """S(1..k): the chance that a draft of `kind` has its first d tokens accepted, its first's being `first`."""
        chance, prior, out = first, self.PRIOR, [first]
        for d in range(2, k + 1):
            accepted, reached = self._counts.get((kind, d), (0.0, 0.0))
            prior = (accepted + self.PRIOR_WEIGHT * prior) / (reached + self.PRIOR_WEIGHT)
            chance *= prior
            out.append(chance)
        return out[:k]

    def learn(self, kind: DraftKind, num_drafted: int, num_accepted: int) -> None:
        """A draft of `kind` had its first `num_accepted` of `num_drafted` tokens accepted."""
        for d in range(2, min(num_drafted, num_accepted + 1) + 1):  # the depths it reached
            _tally(self._counts, (kind, d), d <= num_accepted, self.MEMORY)


class FirstTokenCalibration:
    """How often a draft's first token was accepted when its request's own estimate said `chance`, per drafter: a
    request drafts when its estimate has just risen past what a row costs, often on a lucky run, so beside many
    requests (a high line to clear) the drafts that pass hold less often than their estimates say."""

    BINS = 10  # estimates grouped by tenths
    PRIOR_WEIGHT = 8.0  # an estimate counts as this many drafts accepted at its own chance
    MEMORY = 500.0  # past this many drafts in a bin, older ones count half

    def __init__(self):
        self._counts: dict[tuple[int, int], list[float]] = {}  # (drafter, bin) -> [accepted, drafted]

    def _key(self, drafter: int, chance: float) -> tuple[int, int]:
        return drafter, min(int(chance * self.BINS), self.BINS - 1)

    def __call__(self, drafter: int, chance: float) -> float:
        accepted, drafted = self._counts.get(self._key(drafter, chance), (0.0, 0.0))
        return (accepted + self.PRIOR_WEIGHT * chance) / (drafted + self.PRIOR_WEIGHT)

    def learn(self, drafter: int, chance: float, accepted: bool) -> None:
        _tally(self._counts, self._key(drafter, chance), accepted, self.MEMORY)


class Speculation:
    """Hands out drafts at schedule time and learns from each step's verification."""

    PRIOR = 0.8  # the first request's acceptance estimate: it drafts a few tokens before it knows better
    PRIOR_WEIGHT = 0.01  # how much each draft's first token's outcome, any request's, moves a new request's estimate
    WEIGHT = 0.2  # how much each draft's first token's outcome moves the request's own estimate
    RECOVERY = 0.05  # how far a request that does not draft moves back toward a new request's estimate per step

    def __init__(self, source: DraftSource, max_tokens: int, row_cost: float | None = None):
        self.source = source
        self.max_tokens = max_tokens  # most draft tokens per request per step
        self.step_cost = StepCost(row_cost)  # a step's cost by its rows (row_cost: a fixed share of a step a row)
        self.depths = DepthAcceptance()  # how far a draft's tokens go on being accepted, by its kind
        self.calibration = FirstTokenCalibration()  # how often a request's estimate for a first token held
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
            drafters = self.source.new_drafters(req.options.cache_salt)
            self.priors += [self.PRIOR] * (len(drafters) - len(self.priors))
            state = req.speculation = RequestSpeculation(drafters, self.priors[: len(drafters)])
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return []
        # A draft's d-th token is accepted at most as often as its first: if no drafter's first token would pay
        # for its row, no draft would, and the lookups, host time per request per step, are skipped (chat requests
        # beside many others draft little).
        chances = [self.calibration(i, a) for i, a in enumerate(state.acceptance)]
        if not self._worth_drafting([max(chances)], step):
            self._recover(state, range(len(state.drafters)))
            return []
        context = req.prompt_token_ids + req.output_token_ids
        for i, drafter in enumerate(state.drafters):
            draft = drafter.propose(context, limit)
            if draft:
                break
        else:
            return []
        kind = self.depths.kind(i, drafter.matched, state.last_whole)
        survival = self.depths.survival(kind, chances[i], len(draft))
        k = self._worth_drafting(survival, step)
        if k <= 0:
            self._recover(state, (i,))
            return []
        state.drafting, state.kind, state.survival = i, kind, survival[:k]
        return draft[:k]

    def join(self, req: Request, draft: list[int], step: StepDrafts) -> None:
        """Count `req`'s scheduled draft in its step: a row each, and the tokens they should yield."""
        step.rows += len(draft)
        step.tokens += sum(req.speculation.survival[: len(draft)])

    def _recover(self, state: RequestSpeculation, drafters) -> None:
        """Not worth a row now: the drafters' estimates move slowly back toward a new request's, to probe again."""
        for i in drafters:
            a = state.acceptance[i]
            state.acceptance[i] = min(max(self.priors[i], a), a + self.RECOVERY)

    def _worth_drafting(self, survival: list[float], step: StepDrafts) -> int:
        """The draft length (at most len(survival)) that makes the step the most tokens a second (see the module's
        docstring)."""
        costs = self.step_cost.costs(range(step.rows, step.rows + 1 + len(survival)))
        tokens = step.tokens
        best, best_rate = 0, tokens / costs[0]
        for k, chance in enumerate(survival, 1):
            tokens += chance
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
        i, outcome = state.drafting, float(num_accepted > 0)
        self.calibration.learn(i, state.acceptance[i], num_accepted > 0)
        state.acceptance[i] += self.WEIGHT * (outcome - state.acceptance[i])
        self.priors[i] += self.PRIOR_WEIGHT * (outcome - self.priors[i])
        self.depths.learn(state.kind, num_drafted, num_accepted)
        state.last_whole = num_accepted == num_drafted

    def finished(self, req: Request) -> None:
        if req.speculation is not None:
            self.source.finished(req.output_token_ids, req.options.cache_salt)

    def drain_accepted_lengths(self) -> list[int]:
        lengths, self.accepted_lengths = self.accepted_lengths, []
        return lengths
