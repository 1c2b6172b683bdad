"""Every sampling knob samples the same distribution with speculation as without: the sampler's draws on a tiny
exact "model" (a Markov chain's logits), requests drafting and requests not drafting in one batch, each against the
knobs' distribution computed independently here, by a chi-square test."""

import functools
import itertools
import math

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.model.sampling import sampler as sampler_module
from engine.model.sampling.sampler import Sampler
from engine.model.sampling.state import SamplingState

# Sequences per knob and mode: enough that the unnormalised min_p acceptance and penalties that leave the drafts out
# score far below the threshold (the power check below), few enough that the batch samples in seconds.
V, LENGTH, SAMPLES = 4, 3, 3_000
THRESHOLD = 1e-4  # the p-value a correct sampler must pass: every knob and mode tests against it, so it is low
STOP = 3  # the stop token min_tokens masks
KNOBS = {
    "temperature 1": {},
    "temperature 0.3": {"temperature": 0.3},
    "temperature 1.5": {"temperature": 1.5},
    "top_p": {"top_p": 0.7},
    "top_k": {"top_k": 2},
    "min_p": {"min_p": 0.5},
    "repetition_penalty": {"repetition_penalty": 2.0},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "presence_penalty": {"presence_penalty": -1.0},
    "logit_bias": {"logit_bias": {1: 1.5, 2: -2.0}},
    "min_tokens": {"min_tokens": 2},
    "sharp and trimmed": {"temperature": 0.6, "top_k": 3, "top_p": 0.9, "min_p": 0.3},
    "everything": {
        "temperature": 1.3,
        "top_k": 3,
        "top_p": 0.95,
        "min_p": 0.4,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.4,
        "logit_bias": {0: 1.0, 3: -0.5},
    },
}


def chain() -> torch.Tensor:
    """L[a]: the next token's logits after token a. The drafts (a + 1, a + 2) are the likely tokens, min_p = 0.5 keeps
    just them, and the logits have both signs (the repetition penalty treats the two apart)."""
    probs = torch.tensor([0.10, 0.45, 0.30, 0.15], dtype=torch.float64)
    return torch.stack([probs.roll(a) for a in range(V)]).log() + 1.5


def reference(logits: torch.Tensor, outputs: list[int], prompt: list[int], p: SamplingParams) -> list[float]:
    """The knobs' distribution (OpenAI and vLLM semantics) in float64: bias, penalties, min_tokens, then temperature,
    top-k, top-p (on the top-k's renormalised mass), min-p, each followed by renormalising."""
    x = logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(outputs):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(outputs):
        x[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    if len(outputs) < p.min_tokens:
        x[STOP] = -math.inf
    x = x / p.temperature
    order = x.argsort(descending=True).tolist()
    kept = order[: p.top_k] if p.top_k > 0 else order
    probs = torch.zeros(V, dtype=torch.float64)
    probs[kept] = x[kept].softmax(-1)
    mass = 0.0
    for token in order:
        if mass >= p.top_p:
            probs[token] = 0.0
        mass += float(probs[token])
    probs /= probs.sum()
    probs[probs < p.min_p * probs.max()] = 0.0
    return (probs / probs.sum()).tolist()


def expected_sequences(L: torch.Tensor, p: SamplingParams) -> dict[tuple[int, ...], float]:
    """Each sequence of LENGTH tokens after token 0 (the prompt) -> its probability."""
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, 0
        for t, token in enumerate(seq):
            prob *= reference(L[prev], list(seq[:t]), [0], p)[token]
            prev = token
        out[seq] = prob
    return out


def p_value(expected: dict[tuple[int, ...], float], sequences: list[tuple[int, ...]]) -> float:
    """Chi-square of the sequences' counts against `expected`; cells expected fewer than 5 times are pooled (the
    test's approximation needs it), and a sequence of probability 0 drawn at all scores 0."""
    counts = {}
    for seq in sequences:
        counts[seq] = counts.get(seq, 0) + 1
    if any(expected[seq] == 0.0 for seq in counts):
        return 0.0
    n, stat, cells = len(sequences), 0.0, 0
    pooled_expected = pooled_count = 0.0
    for seq, prob in expected.items():
        if n * prob < 5:
            pooled_expected, pooled_count = pooled_expected + n * prob, pooled_count + counts.get(seq, 0)
        else:
            stat += (counts.get(seq, 0) - n * prob) ** 2 / (n * prob)
            cells += 1
    if pooled_expected > 0:
        stat += (pooled_count - pooled_expected) ** 2 / pooled_expected
        cells += 1
    if cells < 2:  # every draw where the distribution puts all of its mass: nothing to test
        return 1.0
    df = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def sample(L: torch.Tensor, sampler: Sampler, groups: list[tuple[str, bool]]) -> dict[tuple[str, bool], list[tuple]]:
    """SAMPLES sequences per (knob, drafting) group, all requests in one batch a step; a drafting request's drafts
    are two tokens a step from a deterministic proposer (prev + 1, prev + 2). (knob, drafting) -> the sequences."""
    requests = {}
    for name, drafting in groups:
        params = SamplingParams(max_tokens=LENGTH, **KNOBS[name])
        stops = frozenset({STOP}) if params.min_tokens else frozenset()
        requests[name, drafting] = [SamplingState(f"{name}-{drafting}-{i}", [0], params, stops) for i in range(SAMPLES)]
    drafting_of = {id(r): drafting for (_, drafting), group in requests.items() for r in group}
    for r in itertools.chain(*requests.values()):
        sampler.add(r)
    live = list(itertools.chain(*requests.values()))
    while live:
        prev = [(r.output_token_ids or [0])[-1] for r in live]
        drafts = [[(p + 1) % V, (p + 2) % V] if drafting_of[id(r)] else [] for r, p in zip(live, prev)]
        rows = [t for p, d in zip(prev, drafts) for t in [p, *d]]  # the chain's logits after each row's context
        sampler(L[torch.tensor(rows)].float(), [r.request_id for r in live], drafts)
        live = [r for r in live if r.num_output_tokens < LENGTH]
    return {key: [tuple(r.output_token_ids[:LENGTH]) for r in group] for key, group in requests.items()}


def p_value_of(knob: str, sequences: list[tuple[int, ...]]) -> float:
    return p_value(expected_of(knob), sequences)


@functools.cache
def expected_of(knob: str) -> dict[tuple[int, ...], float]:
    return expected_sequences(chain(), SamplingParams(**KNOBS[knob]))


@pytest.fixture(scope="module")
def sequences() -> dict[tuple[str, bool], list[tuple[int, ...]]]:
    return sample(chain(), Sampler(seed=7), list(itertools.product(KNOBS, (False, True))))


@pytest.mark.parametrize("drafting", [False, True], ids=["speculation off", "speculation on"])
@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_samples_its_distribution_with_and_without_drafts(sequences, knob, drafting):
    assert p_value_of(knob, sequences[knob, drafting]) > THRESHOLD


def test_the_test_sees_a_penalty_that_leaves_out_the_drafts(monkeypatch):
    """Its power: draft rows penalised as if their drafts were not outputs yet."""
    monkeypatch.setattr(sampler_module.Row, "output_token_ids", property(lambda row: row.request.output_token_ids))
    [got] = sample(chain(), Sampler(seed=7), [("frequency_penalty", True)]).values()
    assert p_value_of("frequency_penalty", got) < 1e-6


def test_the_reference_knobs_move_the_distribution():
    """Each knob's reference differs from temperature 1's, so a knob the sampler ignored would be seen."""
    plain = expected_sequences(chain(), SamplingParams())
    for name, knobs in KNOBS.items():
        if knobs:
            got = expected_sequences(chain(), SamplingParams(**knobs))
            assert max(abs(got[s] - plain[s]) for s in plain) > 0.01, name


def test_logprobs_under_speculation_are_the_models_own_at_each_token():
    """An accepted draft's logprob and the token's after it are the model's, before any knob, at their positions."""
    L = chain()
    sampler = Sampler(seed=3)
    params = SamplingParams(logprobs=2, **KNOBS["everything"])
    requests = [SamplingState(f"r{i}", [0], params, frozenset()) for i in range(200)]
    for r in requests:
        sampler.add(r)
    out = sampler(L[[0, 1, 2] * len(requests)].float(), [r.request_id for r in requests], [[1, 2]] * len(requests))
    raw = L.float().log_softmax(-1)
    for r in requests:
        prev = 0
        for token, lp in zip(out[r.request_id].token_ids, out[r.request_id].logprobs, strict=True):
            assert lp.token_id == token and lp.logprob == pytest.approx(float(raw[prev, token]), abs=1e-6)
            top = raw[prev].topk(2)
            assert [i for i, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
            prev = token
    assert {len(o.token_ids) for o in out.values()} == {1, 2, 3}  # drafts rejected at once, after one, never
