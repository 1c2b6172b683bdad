"""Speculative decoding's verification: which of a request's draft tokens the target model accepts, and the one token
that follows them, so that the output keeps the target's distribution exactly (issue 30).

The target scores the context and the k draft tokens in one step, giving its distribution at each of the k + 1
positions. For a deterministic proposer (prompt lookup, suffix trees: a draft token has probability 1 under the
proposer) the standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts draft token x with probability p(x);
at the first rejection it draws the next token from p with x removed and renormalised, and after k acceptances it
draws one more token from the last position's p. Each output token is then distributed as p itself.
"""

from __future__ import annotations

import torch


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, V] at the draft's positions -> the draft's prefix that equals the argmax, then the argmax."""
    best = logits.argmax(dim=-1).tolist()
    n = next((i for i, (x, b) in enumerate(zip(draft, best)) if x != b), len(draft))
    return draft[:n] + [best[n]]


def verify_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None = None) -> list[int]:
    """probs [k + 1, V] (the sampling distribution at each position: temperature, top-k/p and the rest applied) ->
    the accepted draft prefix and one token drawn as above."""
    k = len(draft)
    n = k
    if k:
        ids = torch.tensor(draft, device=probs.device)
        chosen = probs[:k].gather(1, ids[:, None])[:, 0]
        u = torch.rand(k, generator=generator, device=probs.device)
        rejected = (u >= chosen).nonzero()
        n = int(rejected[0]) if len(rejected) else k
    p = probs[n]
    if n < k:  # p without the rejected token: what is left of p once the draft's share of it is spent
        p = p.clone()
        p[draft[n]] = 0.0
    token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
    return draft[:n] + [token]
