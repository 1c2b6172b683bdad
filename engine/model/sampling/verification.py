"""Speculative decoding's verification: which of a request's draft tokens the target model accepts, and the one token
that follows them, so that the output keeps the target's distribution exactly (issue 30).

The target scores the context and the k draft tokens in one step, giving its distribution at each of the k + 1
positions. For a deterministic proposer (prompt lookup, suffix trees: a draft token has probability 1 under the
proposer) the standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts draft token x with probability p(x);
at the first rejection it draws the next token from p with x removed and renormalised, and after k acceptances it
draws one more token from the last position's p. Each output token is then distributed as p itself. Greedy decoding
accepts a draft token where it is the argmax.

The device decides every row at once (`draft_acceptance`: each draft row's verdict, and the distribution its
fallback token is drawn from); the host then takes the accepted prefix (`accepted_tokens`).
"""

from __future__ import annotations

import torch

from engine.model.sampling.draw import exponential_race, keys

NO_DRAFT = -1  # the draft id of a row that verifies nothing (a request's last row: its token follows the drafts)


def draft_acceptance(
    probs: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] (the sampling distribution at each row: temperature, top-k/p and the rest applied), each row's
    draft id (NO_DRAFT for none) and a uniform draw per row -> whether each row accepts its draft token x (u < p(x)),
    and the distribution each row's own token is drawn from: p without x (unnormalised), or p where there is no x."""
    has = draft_ids >= 0
    ids = draft_ids.clamp(min=0)[:, None]
    p_x = probs.gather(1, ids)[:, 0]
    # A row is weights, as `exponential_race` reads it (min_p leaves a row's mass below 1): p(x) is its share of the
    # row's mass, or a draft would be accepted against another distribution than the one its row draws from.
    accepted = has & (uniforms < p_x / probs.sum(dim=-1))  # a certain draft: p_x / its own sum is exactly 1
    residual = probs.scatter(1, ids, torch.where(has, torch.zeros_like(p_x), p_x)[:, None])
    # p(x) = 1 leaves nothing: that row always accepts, and what it would draw is never used.
    return accepted, torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)


def accepted_tokens(draft: list[int], tokens: list[int], accepted: list[bool]) -> list[int]:
    """A request's rows -> its draft tokens up to the first rejected one, then that row's own token (the row after
    the last draft token when all are accepted)."""
    n = next((j for j, ok in enumerate(accepted[: len(draft)]) if not ok), len(draft))
    return draft[:n] + [tokens[n]]


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, V] at the draft's positions -> the draft's prefix that equals the argmax, then the argmax."""
    best = logits.argmax(dim=-1).tolist()
    return accepted_tokens(draft, best, [b == x for b, x in zip(best, draft)])


def verify_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None = None) -> list[int]:
    """One request's rows, through the rule the sampler applies to a batch: probs [k + 1, V] -> the accepted draft
    prefix and the token drawn after it."""
    ids = torch.tensor(draft + [NO_DRAFT], device=probs.device)
    uniforms = torch.rand(len(ids), generator=generator, device=probs.device)
    accepted, residual = draft_acceptance(probs, ids, uniforms)
    tokens = exponential_race(residual, keys(len(ids), generator, probs.device))
    return accepted_tokens(draft, tokens.tolist(), accepted.tolist())
