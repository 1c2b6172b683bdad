"""Speculative decoding (issue 30): steps that verify draft tokens give exactly the tokens (and logprobs) of steps that
do not, under every way the scheduler cuts and moves work; sampled tokens keep the target's distribution; rejected
drafts' K/V never reach the prefix cache; nobody gets more than max_tokens."""

import json
import random

import jsonschema
import llguidance
import msgspec
import pytest
import torch
from conftest import PROMPTS, run_staggered
from test_verification import LENGTH, SAMPLES, V, p_value

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.request import Request, RequestOptions, SampledTokens
from engine.core.scheduler import Scheduler
from engine.core.speculation import DepthAcceptance, FirstTokenCalibration, Speculation, StepCost
from engine.drafting import DRAFT_SOURCES
from engine.ipc.messages import EngineStats
from engine.model.sampling import sampler as sampler_module
from engine.model.sampling.sampler import Sampler
from engine.model.sampling.state import SamplingState
from gateway.api.structured import json_schema_grammar
from gateway.web.metrics import Metrics

# Answers that reuse their prompt, so drafts are accepted, beside PROMPTS, whose drafts mostly are not.
GROUNDED = [
    "Repeat exactly: the cat sat on the mat, the dog sat on the log, the cat sat on the mat, the dog sat on the log.",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums.<|im_end|>\n<|im_start|>assistant\n",
]
ALL = PROMPTS + GROUNDED
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# float32 throughout, the cache too; drafts at every batch size
EXACT = {"block_activations": "float32", "kv_cache_dtype": "float32", "speculative_row_cost": 0.01}
BLOCK = 737_280  # bytes of one KV block of the bundled model in float32


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(checkpoint=checkpoint, **EXACT)


@pytest.fixture(scope="module")
def expected(reference):
    return [o.token_ids for o in reference.generate(ALL, GREEDY)]


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.speculation.num_accepted


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_are_the_same_with_staggered_arrivals(checkpoint, expected, method):
    llm = LLM(checkpoint=checkpoint, speculative=method, **EXACT)
    ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in ALL]
    requests = run_staggered(llm.engine, ids, GREEDY)  # and every KV block is free again
    assert [r.output_token_ids for r in requests] == expected
    assert accepted(llm) > 40  # the grounded prompts' drafts were accepted: the test saw speculation


def test_repeated_prompts_draft_from_the_earlier_outputs_to_the_same_tokens(checkpoint, expected):
    """Served again, every prompt drafts from its earlier answer (other requests' recent outputs) where its own
    context has no match: far more is accepted, and the tokens are the same."""
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    assert [o.token_ids for o in llm.generate(ALL, GREEDY)] == expected
    first = accepted(llm)
    ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in ALL]
    requests = run_staggered(llm.engine, ids, GREEDY)
    assert [r.output_token_ids for r in requests] == expected
    assert accepted(llm) - first > 2 * first


@pytest.mark.parametrize(
    "config",
    [
        {"kv_cache_memory": 14 * BLOCK, "max_num_seqs": 8},  # preemption
        {"max_num_batched_tokens": 16},  # chunked prefill, and drafts cut to the token budget
    ],
    ids=["preemption", "chunked-prefill"],
)
def test_greedy_tokens_are_the_same_when_the_scheduler_preempts_or_chunks(checkpoint, expected, config):
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT, **config)
    assert [o.token_ids for o in llm.generate(ALL, GREEDY)] == expected
    assert accepted(llm) > 40
    s = llm.engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks
    if "kv_cache_memory" in config:
        assert s.num_preemptions > 0


def test_prefix_cache_reuse_gives_the_same_tokens(checkpoint, reference):
    """Prompts sharing a long prefix, twice: the second round takes blocks the first one's speculative steps filled."""
    shared = GROUNDED[0] * 3
    prompts = [shared + f" Now number {i}:" for i in range(4)]
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    hits = llm.engine.scheduler.prefix_hit_tokens
    second = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert first == second == want
    assert llm.engine.scheduler.prefix_hit_tokens - hits > 4 * 64 and accepted(llm) > 0


def test_logprobs_of_accepted_tokens_equal_the_non_speculative_ones(checkpoint, reference):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=3)
    want = reference.generate(GROUNDED, params)
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    got = llm.generate(GROUNDED, params)
    assert accepted(llm) > 5
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and [i for i, _ in x.top] == [i for i, _ in y.top]
            assert abs(x.logprob - y.logprob) < 1e-4
            assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-4


def test_the_served_defaults_speculate_to_the_same_greedy_tokens(checkpoint):
    """int16 activations, as served: each row's sums are its own, so verifying rows changes no answer."""
    want = [o.token_ids for o in LLM(checkpoint=checkpoint).generate(ALL, GREEDY)]
    llm = LLM(checkpoint=checkpoint, speculative="suffix", speculative_row_cost=0.01)
    assert [o.token_ids for o in llm.generate(ALL, GREEDY)] == want
    assert accepted(llm) > 40


def test_max_tokens_and_stop_tokens_hold_mid_draft(checkpoint, reference, expected):
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    i = len(PROMPTS)  # the first grounded prompt: its drafts are long
    for n in (1, 2, 5, 13):
        [out] = llm.generate([ALL[i]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert out.token_ids == expected[i][:n] and out.finish_reason == "length"
    stop = expected[i][20]
    [out] = llm.generate([ALL[i]], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)))
    assert out.token_ids == expected[i][: expected[i].index(stop) + 1] and out.finish_reason == "stop"


def test_constrained_outputs_validate_and_match(checkpoint, reference):
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "maxItems": 6, "items": {"type": "string", "maxLength": 12}}},
        "required": ["items"],
        "additionalProperties": False,
    }
    prompt = reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List as JSON: apples, pears, plums, apples, pears, plums."}]
    )
    greedy = SamplingParams(max_tokens=120, temperature=0.0, grammar=json_schema_grammar(schema))
    sampled = [
        SamplingParams(max_tokens=120, temperature=0.8, seed=s, grammar=json_schema_grammar(schema)) for s in range(4)
    ]
    want = reference.generate([prompt], greedy)[0]
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    outs = llm.generate([prompt] * 5, [greedy, *sampled])
    assert outs[0].token_ids == want.token_ids
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.engine.scheduler.speculation.num_drafted > 0


def test_sampled_requests_speculate_and_seeded_ones_keep_their_tokens(checkpoint, reference):
    """Unseeded sampling drafts; a seeded request does not (its draws would follow its drafts, which follow the
    batch), so its tokens are those it gets without speculation, in any batch."""
    llm = LLM(checkpoint=checkpoint, speculative="ngram", **EXACT)
    # Six requests: one sampled request's text may wander off its prompt and accept nothing (1 in 8 engine seeds did).
    llm.generate([GROUNDED[0], GROUNDED[2]] * 3, SamplingParams(max_tokens=40, temperature=0.7, ignore_eos=True))
    assert accepted(llm) > 0
    drafted = llm.engine.scheduler.speculation.num_drafted
    seeded = [SamplingParams(max_tokens=40, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)]
    got = llm.generate([GROUNDED[0], GROUNDED[0], GROUNDED[1]], [seeded[0], GREEDY, seeded[1]])
    want = reference.generate([GROUNDED[0], GROUNDED[1]], seeded)
    assert [got[0].token_ids, got[2].token_ids] == [w.token_ids for w in want]
    assert llm.engine.scheduler.speculation.num_drafted > drafted  # the greedy one beside them drafted


def test_pipeline_stages_speculate_to_the_same_tokens(expected):
    with LLM(speculative="ngram", pipeline_stages=2, **EXACT) as llm:
        assert [o.token_ids for o in llm.generate(ALL, GREEDY)] == expected
        assert accepted(llm) > 40


def test_tensor_parallel_ranks_speculate_to_the_same_tokens():
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9], [10, 11, 10, 11, 10, 11]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = LLM(model="dummy:tiny", **EXACT).generate(prompts, params)
    with LLM(model="dummy:tiny", speculative="ngram", tensor_parallel_size=2, **EXACT) as llm:
        got = llm.generate(prompts, params)
        assert accepted(llm) > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# ------------------------------------------------------------------------------------------ the sampler's rule


def chi_square_p_value(P: torch.Tensor, sampler: Sampler) -> float:
    """SAMPLES sequences of LENGTH tokens after token 0 of the Markov chain P, through the sampler's batched
    verification, two drafts a step from a deterministic proposer (prev + 1, prev + 2); P's exact distribution of
    sequences against their counts."""
    requests = [SamplingState(f"r{i}", [0], SamplingParams(temperature=1.0), frozenset()) for i in range(SAMPLES)]
    for r in requests:
        sampler.add(r)
    while any(r.num_output_tokens < LENGTH for r in requests):
        live = [r for r in requests if r.num_output_tokens < LENGTH]
        prev = [(r.output_token_ids or [0])[-1] for r in live]
        drafts = [[(p + 1) % V, (p + 2) % V] for p in prev]
        rows = torch.stack([P[torch.tensor([p, *d])] for p, d in zip(prev, drafts)]).flatten(0, 1)
        sampler(rows.log(), [r.request_id for r in live], drafts)  # each one's outputs grow by its tokens
    return p_value(P, [tuple(r.output_token_ids[:LENGTH]) for r in requests])


def test_the_samplers_verification_keeps_the_targets_distribution(monkeypatch):
    P = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    assert chi_square_p_value(P, Sampler(seed=7)) > 1e-3

    def keep_the_rejected_token(probs, draft_ids, uniforms):  # a wrong rule: redraw from p itself on rejection
        has = draft_ids >= 0
        return has & (uniforms < probs.gather(1, draft_ids.clamp(min=0)[:, None])[:, 0]), probs

    monkeypatch.setattr(sampler_module, "draft_acceptance", keep_the_rejected_token)
    assert chi_square_p_value(P, Sampler(seed=7)) < 1e-6  # the test has the power to see it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "settings, draft",
    [
        ({"ignore_eos": True}, "eos"),  # a matched regex allows the end of text, which its stopped matcher refuses
        ({"min_tokens": 5}, 0),  # id 0, which a row took when min_tokens masked all its grammar allowed
    ],
)
def test_a_draft_token_its_grammar_refuses_is_never_accepted(tokenizer, temperature, settings, draft):
    """The rows after a draft token the matcher refused are left unmasked: accepting it would let them give a token
    the grammar forbids. The step gives the tokens that steps without drafts give."""
    eos = tokenizer.eos_token_id
    draft = [eos if draft == "eos" else draft] * 2
    params = SamplingParams(temperature=temperature, seed=3, grammar=llguidance.LLMatcher.grammar_from_regex("ab"))
    params = msgspec.structs.replace(params, **settings)
    logits = torch.zeros(len(draft) + 1, tokenizer.vocab_size)
    logits[:, 5] = 10.0  # unconstrained, every row takes token 5

    def state() -> SamplingState:
        stops = frozenset() if params.ignore_eos else frozenset({eos})
        return SamplingState("r", [1, 2], params, stops, tokenizer.encode("ab"))

    sampler = Sampler(tokenizer=tokenizer)
    sampler.add(state())
    got = sampler(logits, ["r"], [draft])["r"].token_ids
    one_by_one = Sampler(tokenizer=tokenizer)
    one_by_one.add(state())
    want = [one_by_one(logits[j : j + 1], ["r"])["r"].token_ids[0] for j in range(len(got))]
    assert got == want and 5 not in got


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_leaves_the_stop_a_finished_grammar_allows(tokenizer, temperature):
    """A matched regex allows only the end of text; min_tokens masked it too, and the row took its fallback, id 0
    (text the format does not allow on a model whose id 0 is a word). The grammar wins: the row gives the stop."""
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        temperature=temperature, seed=3, min_tokens=5, grammar=llguidance.LLMatcher.grammar_from_regex("ab")
    )
    sampler = Sampler(tokenizer=tokenizer)
    sampler.add(SamplingState("r", [1, 2], params, frozenset({eos}), tokenizer.encode("ab")))
    logits = torch.zeros(1, tokenizer.vocab_size)
    logits[:, 5] = 10.0
    assert sampler(logits, ["r"])["r"].token_ids == [eos]


# ------------------------------------------------------------------------------------------ the scheduler's side


class FixedDrafts:
    """A draft source proposing `draft` every time."""

    matched = 0

    def __init__(self, draft):
        self.draft = draft

    def new_drafters(self, salt):
        return [self]

    def propose(self, tokens, k):
        return self.draft[:k]

    def finished(self, output_token_ids, salt):
        pass


def test_rejected_drafts_are_rolled_back_and_never_named_for_the_prefix_cache():
    config = EngineConfig(block_size=4, max_num_batched_tokens=64)
    spec = Speculation(FixedDrafts([50, 51, 52, 53, 54, 55]), max_tokens=6, row_cost=0.0)
    s = Scheduler(config, num_blocks=32, max_model_len=64, speculation=spec)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0))
    s.add(req)
    batch = s.schedule()
    s.update(batch, {"a": SampledTokens([9])})  # prefill: 3 computed, first output
    batch = s.schedule()
    [sr] = batch.requests
    assert sr.token_ids[0] == 9 and sr.num_draft == 6 and sr.draft_token_ids == [50, 51, 52, 53, 54, 55]
    s.update(batch, {"a": SampledTokens([50, 51, 7])})  # two accepted, the third rejected: 7 in its place
    assert req.output_token_ids == [9, 50, 51, 7]
    assert req.num_computed_tokens == 6  # 3 prompt + 9, 50, 51: the rejected drafts' slots are not counted
    assert len(req.block_names) == 1 and req.num_registered_blocks == 1  # tokens 1 2 3 9 only
    assert spec.num_drafted == 6 and spec.num_accepted == 2 and spec.drain_accepted_lengths() == [2]
    # Two tokens left of max_tokens 9 after 4 outputs and at most... the next draft stops short of max_tokens.
    batch = s.schedule()
    [sr] = batch.requests
    assert sr.num_draft == 4  # 9 - 4 outputs - 1: every draft accepted still ends at max_tokens
    s.update(batch, {"a": SampledTokens([50, 51, 52, 53, 8])})
    assert req.num_output_tokens == 9 and req.status.finished
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.drafting


def test_drafts_grow_with_acceptance_and_shrink_as_the_batch_grows():
    spec = Speculation(FixedDrafts(list(range(100, 120))), max_tokens=16, row_cost=0.25)
    req = Request("a", [1, 2], SamplingParams())
    req.output_token_ids = [3]
    # A new request's estimate 0.8, and 0.8 for each later token: (1 + 0.8 + ... + 0.8 ** k) / (1 + 0.25 (1 + k)) is
    # highest at k = 4 (1.49 tokens a unit of time, against 0.8 without drafts).
    assert len(spec.draft(req, 16, spec.new_step(1))) == 4
    assert spec.draft(req, 16, spec.new_step(32)) == []  # beside 31 others a draft token must be accepted 8 times in 9
    for _ in range(30):
        draft = spec.draft(req, 16, spec.new_step(1))
        spec.verified(req, len(draft), len(draft))
    assert (
        len(spec.draft(req, 16, spec.new_step(1))) == len(spec.draft(req, 16, spec.new_step(32))) == 16
    )  # always accepted: as long as allowed
    assert len(spec.draft(req, 3, spec.new_step(1))) == 3  # never past its limit
    for _ in range(30):
        if draft := spec.draft(req, 16, spec.new_step(1)):
            spec.verified(req, len(draft), 0)
    assert spec.draft(req, 16, spec.new_step(1)) == []  # always rejected: it stops drafting
    for _ in range(30):
        spec.draft(req, 16, spec.new_step(1))
    assert 1 <= len(spec.draft(req, 16, spec.new_step(1))) <= 4  # and probes again once its estimate has recovered


def test_a_draft_goes_as_deep_as_drafts_of_its_kind_went():
    """Two requests whose drafts' first tokens are always accepted: one's drafts (a long match) go on to the end, the
    other's (a two-token match) stop after two. Each drafts what its kind's record pays for, and a new request
    with a long match starts from that record."""
    spec = Speculation(FixedDrafts(list(range(100, 120))), max_tokens=8, row_cost=0.25)
    long, short = Request("a", [1, 2], SamplingParams()), Request("b", [1, 2], SamplingParams())
    for req, matched, accepted in ((long, 8, 8), (short, 2, 2)):
        req.output_token_ids = [3]
        spec.source.matched = matched
        for _ in range(40):
            draft = spec.draft(req, 8, spec.new_step(1))
            spec.verified(req, len(draft), min(accepted, len(draft)))
        assert req.speculation.acceptance[0] > 0.99
    spec.source.matched = 8
    assert len(spec.draft(long, 8, spec.new_step(1))) == 8
    spec.source.matched = 2
    assert len(spec.draft(short, 8, spec.new_step(1))) == 2
    newcomer = Request("c", [1, 2], SamplingParams())
    newcomer.output_token_ids = [3]
    spec.source.matched = 8
    assert len(spec.draft(newcomer, 8, spec.new_step(1))) > 4  # 0.8 for its first token, then what long ones earned


def test_a_new_request_starts_from_what_recent_drafts_earned():
    spec = Speculation(FixedDrafts(list(range(100, 120))), max_tokens=8, row_cost=0.25)
    first = Request("a", [1, 2], SamplingParams())
    first.output_token_ids = [3]
    assert (
        len(spec.draft(first, 16, spec.new_step(4))) == 2
    )  # (3 + 1 + 0.8 + 0.64) / (1 + 0.25 * 6): 2.18 against 2.0 undrafted
    for _ in range(100):  # open chat: one draft in three has its first token accepted
        spec.verified(first, 1, 1)
        spec.verified(first, 1, 0)
        spec.verified(first, 1, 0)
    assert spec.priors == [pytest.approx(1 / 3, abs=0.05)]
    later = Request("b", [1, 2], SamplingParams())
    later.output_token_ids = [3]
    assert (
        spec.draft(later, 16, spec.new_step(4)) == []
    )  # beside 3 others a draft token must be accepted one time in two


def test_drafts_take_only_the_blocks_left_after_every_running_requests_next_token():
    """Three decoding requests whose next tokens each start a new block, in a cache with those three blocks free (and
    then one more): nobody is preempted, and the drafts get only the slots left over (the rest of each new block,
    and then the spare block)."""
    for spare, drafts in ((0, [3, 3, 3]), (1, [6, 3, 3])):
        config = EngineConfig(block_size=4, max_num_batched_tokens=64)
        spec = Speculation(FixedDrafts([50, 51, 52, 53, 54, 55]), max_tokens=6, row_cost=0.0)
        s = Scheduler(config, num_blocks=3 + 3 + spare, max_model_len=64, speculation=spec)
        for i, rid in enumerate("abc"):
            s.add(Request(rid, [10 * i + t for t in range(1, 5)], SamplingParams(max_tokens=20, temperature=0.0)))
        batch = s.schedule()  # three prompts of a block each
        s.update(batch, {sr.request_id: SampledTokens([9]) for sr in batch.requests})
        batch = s.schedule()  # each one's next token (position 4) needs a new block
        assert s.num_preemptions == 0
        assert [(sr.request_id, sr.token_ids[0], sr.num_draft) for sr in batch.requests] == [
            ("a", 9, drafts[0]),
            ("b", 9, drafts[1]),
            ("c", 9, drafts[2]),
        ]
        assert s.kv.num_free_blocks == 0


def test_drafts_take_only_the_token_budget_left_after_every_running_requests_tokens():
    """A decoding request before one whose prompt is half computed: the prompt's next chunk takes the budget the
    decode's own token leaves, and the draft only what is left after that (here nothing)."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=8)
    spec = Speculation(FixedDrafts([50, 51, 52, 53, 54, 55]), max_tokens=6, row_cost=0.0)
    s = Scheduler(config, num_blocks=32, max_model_len=64, speculation=spec)
    s.add(Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=20, temperature=0.0)))
    s.add(Request("b", list(range(20, 32)), SamplingParams(max_tokens=20, temperature=0.0)))
    batch = s.schedule()  # a's prompt and b's first 4 tokens
    s.update(batch, {"a": SampledTokens([9])})
    batch = s.schedule()
    assert [(sr.request_id, len(sr.token_ids), sr.num_draft) for sr in batch.requests] == [("a", 1, 0), ("b", 7, 0)]


@pytest.mark.parametrize("owner, other", [(b"alice", b"bob"), (b"alice", b""), (b"", b"alice")])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_request_drafts_only_from_the_outputs_of_requests_with_its_salt(method, owner, other):
    """An answer in the pool of recent outputs drafts for the next request with its salt (an API key's, or none)
    whose context runs into it, never for one with another salt (a step of several tokens would tell that client how
    the answer went on)."""
    spec = Speculation(DRAFT_SOURCES[method](), max_tokens=4, row_cost=0.0)
    s = Scheduler(
        EngineConfig(block_size=4, max_num_batched_tokens=64), num_blocks=64, max_model_len=256, speculation=spec
    )

    def drafts(rid, salt, prompt, outputs):
        """Each step's draft, the model answering `outputs` a token a step (rejecting every draft)."""
        req = Request(
            rid, prompt, SamplingParams(max_tokens=len(outputs), temperature=0.0), options=RequestOptions(salt)
        )
        s.add(req)
        out = []
        while not req.status.finished:
            batch = s.schedule()
            [sr] = batch.requests
            out.append(sr.draft_token_ids)
            s.update(batch, {rid: SampledTokens([outputs[req.num_output_tokens]])})
        return out

    assert drafts("first", owner, [1, 2, 3], [70, 71, 72, 73, 74, 75, 76, 77]) == [[]] * 8
    following = [72, 73, 74, 75, 76, 77]  # after "70 71", as the answer went on
    assert drafts("another's", other, [5, 6, 70, 71], following) == [[]] * 6
    assert drafts("the same salt's", owner, [5, 6, 70, 71], following)[1][:3] == [73, 74, 75]


class TwoDrafters:
    """An own drafter proposing on even-length contexts only, and a shared one proposing always."""

    class Own:
        matched = 0

        def propose(self, tokens, k):
            return list(range(100, 100 + k)) if len(tokens) % 2 == 0 else []

    def __init__(self):
        self.shared = FixedDrafts(list(range(200, 220)))

    def new_drafters(self, salt):
        return [self.Own(), self.shared]

    def finished(self, output_token_ids, salt):
        pass


def test_estimates_that_did_not_hold_are_discounted():
    """Requests whose own estimates said 0.8-0.9 had their drafts' first tokens accepted half the time: a request
    estimating 0.85 is then taken at 0.5, and beside 7 others (where a row pays only above 2/3) it no longer drafts."""
    cal = FirstTokenCalibration()
    assert cal(0, 0.85) == 0.85  # nothing learnt yet: the estimate as it is
    for n in range(200):
        cal.learn(0, 0.85, n % 2 == 0)
    assert cal(0, 0.88) == pytest.approx(0.5, abs=0.02)
    assert cal(1, 0.88) == 0.88 and cal(0, 0.95) == 0.95  # another drafter, another tenth: their own records
    spec = Speculation(FixedDrafts([100, 101]), max_tokens=2, row_cost=0.25)
    req = Request("a", [1, 2], SamplingParams())
    req.output_token_ids = [3]
    spec.draft(req, 2, spec.new_step(1))
    req.speculation.acceptance[0] = 0.85
    assert spec.draft(req, 2, spec.new_step(8))  # taken at its word: 0.85 > 2/3
    spec.calibration = cal
    req.speculation.acceptance[0] = 0.85
    assert spec.draft(req, 2, spec.new_step(8)) == []


def test_each_drafter_is_judged_by_its_own_drafts():
    """Own-context drafts always accepted, other requests' always rejected: the request keeps drafting far from the
    first and stops drafting from the second, and new requests start from each one's record."""
    spec = Speculation(TwoDrafters(), max_tokens=8, row_cost=0.25)
    req = Request("a", [1, 2], SamplingParams())
    for outputs in range(1, 41):
        req.output_token_ids = [3] * outputs
        draft = spec.draft(req, 16, spec.new_step(1))
        own = outputs % 2 == 0  # the context is 2 prompt tokens + the outputs
        assert not draft or draft[0] == (100 if own else 200)
        if draft:
            spec.verified(req, len(draft), len(draft) if own else 0)
    req.output_token_ids = [3, 3]
    assert len(spec.draft(req, 16, spec.new_step(1))) == 8
    req.output_token_ids = [3]
    assert len(spec.draft(req, 16, spec.new_step(1))) <= 1  # nothing, or a probe of one token
    own, other = req.speculation.acceptance
    assert spec.calibration(0, own) > 0.99 and spec.calibration(1, other) < 0.3
    assert spec.priors[0] > Speculation.PRIOR > spec.priors[1]


def test_the_row_cost_is_measured_from_consecutive_decode_steps():
    cost = StepCost()
    assert cost.value == StepCost.PRIOR and cost.costs(range(2)) == [1, 1.25]  # nothing seen: the prior's units
    steady = StepCost()
    for _ in range(200):
        steady.observe(32, 0.05)  # one batch size only: the slope cannot be told, the prior's stands
    assert steady.slope() == pytest.approx(0.05 * 0.25 / 9)
    for _ in range(50):
        for rows in range(1, 10):  # 5 ms a step and 1 ms a row: r = 0.2
            cost.observe(rows, 0.005 + 0.001 * rows)
    assert cost.slope() == pytest.approx(0.001, rel=0.05) and cost.value == pytest.approx(0.2, rel=0.1)
    for _ in range(100):  # the device got slower per row (or rows got longer contexts): the fit follows
        for rows in range(1, 10):
            cost.observe(rows, 0.005 + 0.004 * rows)
    assert cost.slope() == pytest.approx(0.004, rel=0.05) and cost.value == pytest.approx(0.8, rel=0.1)
    assert StepCost(0.01).value == 0.01  # set by the user: kept whatever the steps say


def test_the_row_cost_holds_through_a_noisy_machine():
    """32 steady rows, now and then a few more, on a machine whose speed swings by half and that hiccups: the slope
    is the rows' (1.4 ms a row on a 50 ms step), not the swings'."""
    rng = random.Random(0)
    cost = StepCost()
    for i in range(3000):
        rows = 32 + (rng.choice([1, 2, 4]) if rng.random() < 0.3 else 0)
        speed = 1.5 if (i // 200) % 2 else 1.0  # slow for 200 steps, then fast again
        seconds = speed * (0.0052 + 0.0014 * rows) * rng.uniform(0.95, 1.05)
        cost.observe(rows, seconds * (20 if rng.random() < 0.005 else 1))
        if i > 500 and i % 100 == 99:
            assert cost.slope() == pytest.approx(0.0014 * speed, rel=0.25)


def test_a_full_batch_of_doubtful_drafts_stays_undrafted_where_rows_are_dear():
    """Rows measured dear (the CPU at 32 rows: a row ~1/36 of the step) and noisy: 32 requests whose drafts are
    accepted half the time draft nothing, while requests accepted 19 times in 20 draft a few tokens each, and never
    so many that the rows they add cost more than their tokens bring."""
    rng = random.Random(1)
    spec = Speculation(FixedDrafts(list(range(100, 120))), max_tokens=8)
    for _ in range(300):
        rows = 32 + rng.choice([0, 0, 1, 3])
        spec.step_cost.observe(rows, (0.005 + 0.0014 * rows) * rng.uniform(0.9, 1.1))
    for acceptance, lengths in ((0.5, {0}), (0.95, {1, 2, 3, 4, 5})):
        spec.depths = DepthAcceptance()  # drafts of a new request's kind went on at `acceptance` a token
        for _ in range(500):
            accepted = next((d for d in range(8) if rng.random() > acceptance), 8)
            spec.depths.learn(spec.depths.kind(0, 0, None), 8, accepted)
        step = spec.new_step(32)
        drafts = []
        for i in range(32):
            req = Request(str(i), [1, 2], SamplingParams())
            req.output_token_ids = [3]
            spec.draft(req, 16, spec.new_step(1))  # made its drafter: now set its estimate
            req.speculation.acceptance = [acceptance]
            draft = spec.draft(req, 16, step)
            spec.join(req, draft, step)  # scheduled: the scheduler counts it in the step
            drafts.append(len(draft))
        assert set(drafts) <= lengths and (acceptance < 0.9 or sum(drafts) > 32), drafts
        assert step.rows == 32 + sum(drafts)


def test_a_measured_cost_of_rows_near_free_lets_a_full_batch_draft():
    spec = Speculation(FixedDrafts(list(range(100, 120))), max_tokens=8)
    req = Request("a", [1, 2], SamplingParams())
    req.output_token_ids = [3]
    assert spec.draft(req, 16, spec.new_step(32)) == []  # the prior: beside 31 others, 0.8 is not enough
    for _ in range(10):
        for rows in range(32, 64, 4):  # a GPU decode step: 10 ms fixed, 20 us a row
            spec.step_cost.observe(rows, 0.010 + 0.00002 * rows)
    assert len(spec.draft(req, 16, spec.new_step(32))) >= 4


def test_metrics_report_drafted_and_accepted_tokens():
    m = Metrics()
    m.observe_stats(
        EngineStats(
            1,
            0,
            3,
            5,
            9,
            1,
            spec_draft_tokens_total=12,
            spec_accepted_tokens_total=7,
            spec_accepted_lengths=[0, 3, 4],
            spec_row_cost=0.3,
        )
    )
    text = m.render().decode()
    assert 'orcinus_spec_decode_draft_tokens{replica="0"} 12.0' in text
    assert 'orcinus_spec_decode_accepted_tokens{replica="0"} 7.0' in text
    assert 'orcinus_spec_decode_accepted_length_bucket{le="3.0",replica="0"} 2.0' in text
    assert 'orcinus_spec_decode_accepted_length_count{replica="0"} 3.0' in text
    assert 'orcinus_spec_decode_row_cost{replica="0"} 0.3' in text


def test_a_stop_string_inside_a_step_of_several_tokens_ends_the_choice_there(client, model):
    """Served with the defaults (speculating on the CPU): a delta may carry several tokens; those after the one that
    completes the stop string are not the choice's, in its text, its logprobs or its usage."""
    kw = {"model": model, "prompt": GROUNDED[0], "max_tokens": 40, "temperature": 0}
    free = client.completions.create(**kw, logprobs=1)
    pieces = free.choices[0].logprobs.tokens
    text = "".join(pieces)
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    expected = next(k for k in range(1, len(pieces) + 1) if stop in "".join(pieces[:k]))
    cut = client.completions.create(**kw, logprobs=1, stop=[stop])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    assert cut.usage.completion_tokens == expected == len(choice.logprobs.tokens)
