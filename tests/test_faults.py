"""Fault isolation: a request whose sampling raises fails alone, a forward pass that raises fails only its batch;
the others get the reference tokens, every KV block comes back, and the engine goes on (faults injected by a
FaultPlan in the engine's config, never an environment variable)."""

import httpx
import openai
import pytest
from conftest import PROMPTS, parse_metrics, wait_for_metrics
from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

from engine import LLM, SamplingParams
from engine.core.config import FaultPlan

MARK = 4321  # a token id none of the prompts holds: a prompt with it fails in sampling
PUBLISH_MARK = 4322  # ... and one with this fails while the engine process publishes its tokens
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS[:4]]
    assert not any(MARK in p or PUBLISH_MARK in p for p in ids)
    return ids


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return [c.token_ids for c in LLM(checkpoint=checkpoint, dtype="float32").generate(prompts, GREEDY)]


def test_a_request_whose_sampling_raises_fails_alone(checkpoint, prompts, reference):
    llm = LLM(checkpoint=checkpoint, dtype="float32", faults=FaultPlan(sampler_token=MARK))
    bad = prompts[1][:5] + [MARK] + prompts[1][5:]
    outs = llm.generate(prompts[:1] + [bad] + prompts[2:], GREEDY)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == reference[:1] + reference[2:]
    s = llm.engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_unfinished()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference  # and it goes on


def test_a_constrained_survivor_of_a_sampling_fault_advances_its_grammar_once(checkpoint, prompts):
    """The fault is raised after the batch sampled: resampling request by request must not feed the grammar
    matcher (nor a seeded generator) a second token, so the survivor's output equals a fault-free run's."""
    import json

    from gateway.api.structured import json_schema_grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, grammar=json_schema_grammar(schema))
    [clean] = LLM(checkpoint=checkpoint, dtype="float32").generate([prompts[0]], params)
    llm = LLM(checkpoint=checkpoint, dtype="float32", faults=FaultPlan(sampler_token=MARK))
    bad = prompts[1][:5] + [MARK] + prompts[1][5:]
    survivor, failed = llm.generate([prompts[0], bad], [params, GREEDY])
    assert failed.finish_reason == "error"
    assert survivor.token_ids == clean.token_ids
    if survivor.finish_reason == "stop":
        assert "n" in json.loads(survivor.text)


def test_a_request_whose_grammar_fails_ends_with_an_error_not_unconstrained(checkpoint, prompts, reference):
    llm = LLM(checkpoint=checkpoint, dtype="float32")
    broken = SamplingParams(max_tokens=12, temperature=0.0, grammar="this is not a grammar")
    outs = llm.generate(prompts[:2], [broken, GREEDY])
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert outs[1].token_ids == reference[1]
    s = llm.engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_forward_pass_that_raises_fails_only_its_batch(checkpoint, prompts, reference):
    llm = LLM(checkpoint=checkpoint, dtype="float32", faults=FaultPlan(runner_iterations=(3,)))
    first = llm.generate(prompts[:2], GREEDY)  # iterations 1-2 fine, 3 raises: both requests were in it
    assert [o.finish_reason for o in first] == ["error", "error"]
    s = llm.engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference  # the engine goes on


def test_a_failed_request_is_a_500_or_an_error_event_and_the_server_serves_the_others(
    server_factory, prompts, tokenizer
):
    plan = f'{{"sampler_token": {MARK}, "publish_token": {PUBLISH_MARK}}}'
    with server_factory("--faults", plan) as url:
        bad = prompts[1][:5] + [MARK] + prompts[1][5:]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": bad, "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "sampling failed" in r.json()["error"]["message"]
        with httpx.stream(
            "POST", f"{url}/v1/completions", timeout=60, json={"prompt": bad, "max_tokens": 4, "stream": True}
        ) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data:")]
        assert '"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        unpublishable = [PUBLISH_MARK] + prompts[2]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": unpublishable, "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and "publishing its tokens failed" in r.json()["error"]["message"]
        # The Responses API streams it as OpenAI's typed events: `error`, then response.failed (the SDK's models).
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert tokenizer.decode([MARK]) == "zing"  # its chat prompt holds the mark
        stream = client.responses.create(
            model=client.models.list().data[0].id, input="zing", max_output_tokens=4, stream=True
        )
        events = [e.to_dict() for e in stream]
        assert [(e["type"], e["sequence_number"]) for e in events] == [
            ("response.created", 0),
            ("response.in_progress", 1),
            ("error", 2),
            ("response.failed", 3),
        ]
        error, failed = ResponseErrorEvent.model_validate(events[2]), ResponseFailedEvent.model_validate(events[3])
        assert "sampling failed" in error.message and failed.response.error.code == "server_error"
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        m = wait_for_metrics(
            lambda: parse_metrics(httpx.get(f"{url}/metrics").text),
            lambda m: m["orcinus_kv_blocks_used"] == 0,
            30,
            "blocks freed",
        )
        assert m["orcinus_requests_failed_total"] == 4 and m["orcinus_engine_restarts_total"] == 0
