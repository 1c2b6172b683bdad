"""Sampling on the real model: seeds, finish reasons, logprobs, penalties, bias."""

import math

import pytest

from engine import LLM, InvalidRequestError, SamplingParams

PROMPT = "Write a short story about a robot:"


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, dtype="float32")


def test_same_seed_same_tokens_whatever_else_is_in_the_batch(llm):
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    [alone] = llm.generate([PROMPT], p)
    others = [SamplingParams(max_tokens=30, temperature=1.0), SamplingParams(max_tokens=8, temperature=0.7, seed=9)]
    batched = llm.generate(["Hello there", PROMPT, "Numbers: 1 2 3"], [others[0], p, others[1]])
    assert batched[1].token_ids == alone.token_ids
    [other_seed] = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=4321))
    assert other_seed.token_ids != alone.token_ids


def test_the_sampler_keeps_state_only_for_live_requests(llm):
    """Generators, outputs and grammar matchers of finished and aborted requests are released."""
    sampler = llm.engine.executor.sampler
    llm.generate(
        [PROMPT, "Hello"],
        [
            SamplingParams(max_tokens=6, temperature=1.0, seed=3),
            SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=0.5),
        ],
    )
    assert sampler.states == {}
    req = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, temperature=1.0, seed=5))
    while req.num_output_tokens < 2:
        llm.engine.step()
    assert sampler.states[req.request_id].output_token_ids == req.output_token_ids
    llm.engine.abort_request(req.request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert sampler.states == {}


def test_max_tokens_finishes_with_length(llm):
    [c] = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert c.finish_reason == "length" and len(c.token_ids) == 5


def test_stop_token_finishes_with_stop(llm, tokenizer):
    [free] = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0))
    stop_id = free.token_ids[3]
    [c] = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_id,)))
    assert c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    # As vLLM's: the stop token counts, but its text (a plain token's here) is not the completion's.
    assert stop_id not in tokenizer.special_token_ids
    assert c.text == tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)


def test_eos_finishes_with_stop_and_min_tokens_masks_it(llm, tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    [c] = llm.generate([chat], SamplingParams(max_tokens=200, temperature=0.0))
    assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id
    n = len(c.token_ids)
    [longer] = llm.generate([chat], SamplingParams(max_tokens=n + 5, min_tokens=n + 5, temperature=0.0))
    assert tokenizer.eos_token_id not in longer.token_ids and len(longer.token_ids) == n + 5


def test_logprobs_of_chosen_and_top_tokens(llm):
    [c] = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5))
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == tok and len(lp.top) == 5
        assert lp.top[0][0] == tok  # greedy picks the top token
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        assert lp.logprob <= 0.0
    assert sum(math.exp(v) for _, v in c.logprobs[0].top) <= 1.0 + 1e-5


def test_logit_bias_forces_a_token(llm):
    [c] = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={42: 100.0}))
    assert c.token_ids == [42, 42, 42]


def test_frequency_penalty_breaks_repetition(llm):
    prompt = "a a a a a a a a a a a a"
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    [pen] = llm.generate(
        [prompt],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.5),
    )
    assert len(set(pen.token_ids)) > len(set(plain.token_ids))


def test_top_k_1_is_greedy(llm):
    [g] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))
    [k1] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.5, top_k=1))
    assert g.token_ids == k1.token_ids


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_params_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_engine_rejects_what_can_never_run(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request([1], SamplingParams(logit_bias={-1: 1.0}))
    assert not engine.has_unfinished()


def test_a_prompt_that_fills_the_context_window_is_scored(checkpoint, llm):
    """A prompt-only request (the API's max_tokens 0) of exactly max_model_len tokens runs: its prompt logprobs are
    the ones a roomier engine gives, it outputs nothing, and every block is free after (issue 60)."""
    small = LLM(checkpoint=checkpoint, dtype="float32", max_model_len=32)
    ids = small.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:32]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, prompt_only=True)
    [scored] = small.generate([ids], params)
    [ref] = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert scored.finish_reason == "length" and scored.token_ids == [] and len(scored.prompt_logprobs) == 32
    assert [t.token_id for t in scored.prompt_logprobs[1:]] == ids[1:]
    assert [t.logprob for t in scored.prompt_logprobs[1:]] == pytest.approx(
        [t.logprob for t in ref.prompt_logprobs[1:]], abs=1e-4
    )
    kv = small.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        small.engine.add_request(ids + [ids[1]], params)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        small.engine.add_request(ids, SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=3, temperature=1e-38),  # greedy: dividing by it would overflow
        SamplingParams(max_tokens=3, temperature=1.0, top_p=5e-324),  # rounds to 0 in float32
        SamplingParams(max_tokens=3, temperature=1.0, repetition_penalty=5e-324),  # logits / it = inf
        SamplingParams(max_tokens=3, temperature=1.0, repetition_penalty=1e-38, seed=3),
    ],
)
def test_extreme_settings_sample_the_most_likely_token_instead_of_crashing(llm, params):
    [greedy] = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    [c] = llm.generate([PROMPT], params)
    assert len(c.token_ids) == 3
    if params.repetition_penalty == 1.0:
        assert c.token_ids[0] == greedy.token_ids[0]


# ---------------------------------------------------------------- the distributions top-k, top-p and min-p leave


def distribution(probs: list[float], **params) -> list[float]:
    """The probabilities the sampler draws from, for one request whose model gives `probs`."""
    import torch

    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    req = SamplingState("r", [1], SamplingParams(temperature=1.0, **params), frozenset())
    return Sampler()._probs(torch.tensor([probs]).log(), [req])[0].tolist()


P = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(
    "params,expected",
    [
        ({}, P),
        ({"top_k": 2}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        ({"top_k": 1}, [1, 0, 0, 0]),
        ({"top_k": 4}, P),
        ({"top_p": 0.6}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),  # 0.4 < 0.6: the 0.3 joins; then 0.7 >= 0.6
        ({"top_p": 0.35}, [1, 0, 0, 0]),  # the first token's mass already reaches it
        ({"top_p": 0.75}, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
        ({"top_k": 3, "top_p": 0.6}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        ({"min_p": 0.6}, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),  # below 0.6 * 0.4 = 0.24 goes
        ({"min_p": 0.2, "top_k": 3}, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
    ],
)
def test_top_k_top_p_and_min_p_leave_the_expected_distribution(params, expected):
    got = distribution(P, **params)
    # min_p leaves the kept probabilities unnormalized (multinomial normalizes): compare the shapes.
    total = sum(got)
    assert [g / total for g in got] == pytest.approx(expected, abs=1e-6)


def test_temperature_sharpens_and_flattens():
    import torch

    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    logits = torch.tensor([P]).log()
    for t in (0.5, 2.0):
        [row] = Sampler()._probs(logits, [SamplingState("r", [1], SamplingParams(temperature=t), frozenset())]).tolist()
        expected = [p ** (1 / t) for p in P]
        assert row == pytest.approx([e / sum(expected) for e in expected], abs=1e-6)


def test_draws_follow_the_distribution():
    """20k seeded draws from top_p=0.75 over P: each kept token's frequency within 1.5% of its probability."""
    import torch

    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    sampler = Sampler(seed=3)
    ids = [f"r{i}" for i in range(20000)]
    for request_id in ids:
        sampler.add(SamplingState(request_id, [1], SamplingParams(temperature=1.0, top_p=0.75), frozenset()))
    tokens = sampler(torch.tensor([P] * len(ids)).log(), ids)
    counts = [0] * 4
    for (token,) in (t.token_ids for t in tokens.values()):
        counts[token] += 1
    assert counts[3] == 0
    assert [c / len(ids) for c in counts[:3]] == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9], abs=0.015)


def test_the_race_draws_from_p_never_a_token_without_mass_and_shrugs_off_the_last_bits():
    """The exponential race (engine/model/sampling/draw.py): frequencies follow p (unnormalized), a token of
    probability 0 never wins, and noise of 1e-4 in every logit leaves the winners alone (an inverse CDF, whose token
    hangs on a running sum over the vocabulary, changed 30 of 1,000 draws so over 49,152 tokens)."""
    import torch

    from engine.model.sampling.draw import exponential_race, keys

    g = torch.Generator().manual_seed(5)
    p = torch.tensor([0.4, 0.3, 0.0, 0.2, 0.1]) * 3  # unnormalized
    n = 100_000
    draws = exponential_race(p.expand(n, 5).contiguous(), keys(n, g))
    freq = torch.bincount(draws, minlength=5).double() / n
    assert freq[2] == 0
    assert freq.tolist() == pytest.approx([0.4, 0.3, 0.0, 0.2, 0.1], abs=0.006)  # ~4 standard errors

    logits = torch.randn(300, 49152, generator=g) * 3
    logits[:, ::2] = float("-inf")  # half the vocabulary without mass
    probs = (logits / 0.9).softmax(-1)
    nudged = ((logits + 1e-4 * torch.randn(logits.shape, generator=g)) / 0.9).softmax(-1)
    row_keys = keys(300, g)
    a, b = exponential_race(probs, row_keys), exponential_race(nudged, row_keys)
    assert (probs.gather(1, a[:, None]) > 0).all()
    assert (a != b).sum() <= 1


def test_the_cpu_race_op_draws_the_torch_race_s_tokens():
    """The C++ op (which skips the log wherever a token's bound cannot beat the best) and the torch ops draw the same
    token from the same key: flat and peaked rows, zeros, a one-hot row, a vocabulary of 1 and one not a multiple of
    the op's chunk; and each row's draw is its own (a row alone draws what it draws in a batch)."""
    import torch

    from engine.model.sampling import draw

    if draw.sampling_op() is None:
        pytest.skip("the C++ op does not build here")
    g = torch.Generator().manual_seed(7)
    for vocab, scale in ((49152, 3.0), (49152, 12.0), (1001, 1.0), (7, 0.5), (1, 1.0), (129, 30.0)):
        probs = (torch.randn(64, vocab, generator=g) * scale).softmax(-1)
        probs[::3, : vocab // 2] = 0.0
        probs[5] = 0.0
        probs[5, vocab - 1] = 1.0
        row_keys = draw.keys(64, g)
        op = draw.exponential_race(probs, row_keys)
        assert op.tolist() == draw.exponential_race_reference(probs, row_keys).tolist(), vocab
        assert (probs.gather(1, op[:, None]) > 0).all() and op[5] == vocab - 1
        assert draw.exponential_race(probs[9:10], row_keys[9:10]).item() == op[9]
    probs = (torch.randn(100, 49152, generator=g) * 3).softmax(-1)  # the reference a few rows at a time
    row_keys = draw.keys(100, g)
    assert draw.exponential_race(probs, row_keys).tolist() == draw.exponential_race_reference(probs, row_keys).tolist()
    u = draw.odd_uniforms(draw.keys(4, g), 100_000).double() / 2**24  # the uniforms themselves: mean and spread
    assert u.min() > 0 and u.max() < 1
    assert u.mean().item() == pytest.approx(0.5, abs=0.002) and u.var().item() == pytest.approx(1 / 12, abs=0.001)


def test_the_cpu_greedy_op_picks_torch_max_s_indices():
    """The C++ argmax gives torch.max(dim=-1)'s indices bit for bit: the first of tied maxima (in one vector lane or
    across lanes, +0 tying -0), the first NaN wherever it sits, all -inf rows, the largest in the tail past the vector
    part, vocabularies shorter than a vector, and 262k-wide rows."""
    import torch

    from engine.model.sampling import draw

    if draw.sampling_op() is None:
        pytest.skip("the C++ op does not build here")
    g = torch.Generator().manual_seed(11)
    for vocab in (1, 7, 16, 17, 33, 1001, 262144):
        x = torch.randn(24, vocab, generator=g)
        x[1] = 0.0  # all tied: the first
        x[2] = float("-inf")
        x[3, vocab // 2 :] = 5.0  # tied in many lanes: the first of them
        x[4, -1] = 9.0  # the tail
        x[5, vocab // 3] = float("nan")
        x[5, -1] = float("nan")
        x[6, 0] = -0.0
        x[6, 1:] = 0.0
        x[6, vocab // 2] = -0.0
        x[7, -1] = float("nan")
        x[8, vocab // 4] = float("inf")
        x[8, vocab // 2] = float("inf")
        x[9, vocab // 5 :: 16] = 7.0  # tied in one lane
        x[10, (vocab - 1) // 16 * 16 :] = 3.0  # tied between the last lane pass and the tail
        x[10, (vocab - 1) // 16 * 16 - 1] = 3.0
        assert draw.greedy(x).tolist() == x.max(dim=-1).indices.tolist(), vocab
    assert draw.greedy(torch.zeros(0, 5)).tolist() == []
