"""Speculative verification (engine/model/sampling/verification.py): greedy keeps the argmax tokens, and sampling with drafts
keeps the target's distribution, checked by a chi-square test on a model whose distribution is known exactly."""

import itertools

import pytest
import torch

from engine.model.sampling.verification import draft_acceptance, verify_greedy, verify_sampled

# 8,000 samples: the wrong rule below scores p = 0.0 already at 5,000 (20,000 took 16 s of the suite).
V, LENGTH, SAMPLES = 4, 3, 8_000


def markov_chain() -> torch.Tensor:
    """The tiny exact "model": P[a] is the next token's distribution after token a."""
    return torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)), dim=-1)


def speculate(P: torch.Tensor, verify, generator) -> tuple[int, ...]:
    """LENGTH tokens after token 0, drafting two tokens a step from a deterministic proposer (prev + 1, prev + 2)."""
    out = [0]
    while len(out) <= LENGTH:
        prev = out[-1]
        draft = [(prev + 1) % V, (prev + 2) % V]
        probs = torch.stack([P[prev], P[draft[0]], P[draft[1]]])  # the target's p at each drafted position
        out += verify(probs, draft, generator)
    return tuple(out[1 : LENGTH + 1])


def chi_square_p_value(P: torch.Tensor, verify) -> float:
    generator = torch.Generator().manual_seed(7)
    return p_value(P, [speculate(P, verify, generator) for _ in range(SAMPLES)])


def p_value(P: torch.Tensor, sequences: list[tuple[int, ...]]) -> float:
    """Chi-square test of SAMPLES sequences of LENGTH tokens after token 0 against the chain P's exact distribution."""
    counts = {}
    for seq in sequences:
        counts[seq] = counts.get(seq, 0) + 1
    stat = 0.0
    for seq in itertools.product(range(V), repeat=LENGTH):
        expected = SAMPLES * float(P[0, seq[0]] * P[seq[0], seq[1]] * P[seq[1], seq[2]])
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
    df = V**LENGTH - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def resample_from_p(probs, draft, generator):
    """A wrong rule: at a rejection draw from p itself, the rejected token included."""
    n = len(draft)
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=generator)) >= float(probs[i, x]):
            n = i
            break
    return draft[:n] + [int(torch.multinomial(probs[n], 1, generator=generator))]


def test_sampling_with_drafts_keeps_the_targets_distribution():
    P = markov_chain()
    assert chi_square_p_value(P, verify_sampled) > 1e-3
    # The test has the power to see a wrong rule: the same samples' count with the rejected token left in.
    assert chi_square_p_value(P, resample_from_p) < 1e-6


def test_greedy_verification_takes_the_argmax_prefix_then_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])  # argmax 1, 0, 2
    assert verify_greedy(logits, [1, 0]) == [1, 0, 2]  # all accepted, then the bonus token
    assert verify_greedy(logits, [1, 2]) == [1, 0]  # the second is wrong: the argmax replaces it
    assert verify_greedy(logits, [2, 0]) == [1]
    assert verify_greedy(logits[:1], []) == [1]  # no draft: plain greedy decoding


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = verify_sampled(probs, [1, 1], g)
        assert out[0] == 1 and len(out) == 2 and out[1] != 1  # p(1) = 1 accepted; p(1) = 0 at step 2 rejected


def test_a_draft_is_accepted_with_its_share_of_its_rows_mass():
    """min_p leaves a row's weights summing below 1, and the draw reads them as weights: p = [.5, .3, .2] with
    min_p = .5 is [.5, .3, 0], which draws token 0 with .625, so a drafted 0 is accepted for u below .625."""
    probs = torch.tensor([[0.5, 0.3, 0.0]] * 3)
    accepted, residual = draft_acceptance(probs, torch.tensor([0, 0, 0]), torch.tensor([0.55, 0.62, 0.63]))
    assert accepted.tolist() == [True, True, False]
    assert residual[0].tolist() == pytest.approx([0.0, 0.3, 0.0])  # rejected: token 1 alone
