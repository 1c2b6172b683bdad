"""The sampler over a large vocabulary: top-k / top-p by a partial sort keep the full sort's tokens, penalties touch only
the generated tokens, logprobs are computed only for the rows that asked, greedy rows take the argmax."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.model.sampling.draw import exponential_race, keys
from engine.model.sampling.nucleus import nucleus
from engine.model.sampling.sampler import Sampler
from engine.model.sampling.state import SamplingState

VOCAB = 50_000


def full_sort(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """The sampler's top-k / top-p as it was, row by row (a row with neither keeps every token): a sort of the row."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, (k, p) in enumerate(zip(top_ks, top_ps)):
        k = k if 0 < k < vocab else vocab
        if k == vocab and p >= 1.0:
            continue
        sorted_logits, order = logits[i].sort(descending=True)
        drop = torch.arange(vocab) >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= p
        drop[0] = False
        out[i] = logits[i].scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return out


def tensor(values, dtype=None):
    return torch.tensor(values, dtype=dtype)


# (top_k, top_p) per row; the flat rows' top-p sets reach past the first candidates, so the search widens.
SETTINGS = [
    (40, 1.0),
    (0, 0.9),
    (0, 0.5),
    (40, 0.9),
    (5000, 0.95),
    (0, 1.0),  # neither: every token kept, whatever the others ask
    (1, 1.0),
    (0, 0.97),
]


@pytest.mark.parametrize("scale", [3.0, 0.3], ids=["peaked", "flat"])
def test_the_partial_sort_keeps_the_full_sorts_tokens(scale):
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(5)) * scale
    ks, ps = [k for k, _ in SETTINGS], [p for _, p in SETTINGS]
    got, want = nucleus(logits, ks, ps, tensor), full_sort(logits, ks, ps)
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[want.isfinite()], want[want.isfinite()])  # the kept tokens' logits, untouched
    assert torch.allclose(got.softmax(-1), want.softmax(-1), atol=1e-6, rtol=0)
    assert int(got.isfinite().sum(-1)[5]) == VOCAB


def test_a_top_p_in_the_rounding_of_the_tail_keeps_the_full_sorts_distribution():
    """At top_p 0.999 over a flat row each token is below float32's resolution of the running mass: its sum's order
    (over the whole row, not the sorted one) decides a few tail tokens, and they weigh nothing."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 0.3
    got, want = nucleus(logits, [0, 0], [0.999, 0.9995], tensor), full_sort(logits, [0, 0], [0.999, 0.9995])
    assert torch.allclose(got.softmax(-1), want.softmax(-1), atol=1e-6, rtol=0)


def states(settings: list[dict], outputs: list[int] | None = None) -> list[SamplingState]:
    return [
        SamplingState(f"r{i}", [3, 4, 5], SamplingParams(**s), frozenset(), list(outputs or []))
        for i, s in enumerate(settings)
    ]


def sample(logits: torch.Tensor, reqs: list[SamplingState], seed: int = 1) -> dict:
    sampler = Sampler(seed=seed)
    for r in reqs:
        sampler.add(r)
    return sampler(logits, [r.request_id for r in reqs])


def test_top_k_and_top_p_never_sort_the_whole_vocabulary(monkeypatch):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 3

    def no_sort(*args, **kwargs):
        raise AssertionError("a full sort of the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    reqs = states([{"temperature": 0.7, "top_k": 40}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0}])
    assert len(sample(logits, reqs)) == 3


def test_seeded_draws_are_the_full_sorts():
    """The draw reads the same distribution as before: with the shared generator's keys, the tokens of a race over
    the full sort's probabilities."""
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    reqs = states([{"temperature": 0.8, "top_k": k, "top_p": p} for k, p in SETTINGS])
    got = [s.token_ids[0] for s in sample(logits, reqs, seed=11).values()]
    want_probs = full_sort(logits / 0.8, [k for k, _ in SETTINGS], [p for _, p in SETTINGS]).softmax(-1)
    want = exponential_race(want_probs, keys(len(SETTINGS), torch.Generator().manual_seed(11)))
    assert got == want.tolist()


def test_greedy_rows_take_the_softmax_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    reqs = states([{"temperature": 0.0}] * 3 + [{"temperature": 0.7, "top_p": 0.9}] * 3)
    got = [s.token_ids[0] for s in sample(logits, reqs).values()]
    assert got[:3] == logits[:3].softmax(-1).argmax(-1).tolist()


def test_penalties_change_only_the_generated_tokens_as_the_dense_counts_did():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    outputs = [7, 7, 9, 49_999, 7, 123]
    [req] = states([{"temperature": 1.0, "frequency_penalty": 0.7, "presence_penalty": -0.3}], outputs)
    got = logits[0].clone()
    Sampler()._penalize(got, req, outputs)
    counts = torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
    want = logits[0] - (0.7 * counts + -0.3 * (counts > 0).float())
    assert torch.equal(got, want)


def test_logprobs_are_computed_only_for_the_rows_that_ask_and_equal_alone(monkeypatch):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    settings = [{"temperature": 0.0}, {"temperature": 0.0, "logprobs": 3}, {"temperature": 0.7}, {"temperature": 0.0}]
    [alone] = sample(logits[1:2], states([settings[1]])).values()
    real, widths = torch.log_softmax, []

    def counting(x, *args, **kwargs):
        widths.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", counting)
    out = list(sample(logits, states(settings)).values())
    assert widths == [1]  # one row asked
    assert out[1].logprobs == alone.logprobs
    assert [o.logprobs for i, o in enumerate(out) if i != 1] == [None, None, None]
    assert out[1].logprobs[0].logprob == pytest.approx(float(real(logits[1], -1)[out[1].token_ids[0]]), abs=1e-6)


def test_the_cpu_row_sums_are_torchs():
    from engine.model.sampling.draw import sampling_op

    if sampling_op() is None:
        pytest.skip("the C++ op does not build here")
    rows = torch.randn(5, 70_001, generator=torch.Generator().manual_seed(6)) * 4
    rows[2, :100] = float("-inf")  # masked tokens add nothing
    top = rows.max(dim=-1).values
    want = (rows.double() - top[:, None].double()).exp().sum(-1).float()
    assert torch.allclose(sampling_op().exp_sums(rows, top), want, rtol=1e-6, atol=0)


def test_min_p_keeps_what_the_row_max_kept():
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(8)) * 3
    reqs = states([{"temperature": 0.8, "top_k": k, "top_p": p, "min_p": 0.05} for k, p in SETTINGS])
    got = Sampler()._probs(logits, reqs)
    probs = full_sort(logits / 0.8, [k for k, _ in SETTINGS], [p for _, p in SETTINGS]).softmax(-1)
    want = probs.masked_fill(probs < 0.05 * probs.max(dim=-1, keepdim=True).values, 0.0)
    assert torch.equal(got, want)
