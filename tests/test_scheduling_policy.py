"""Scheduling policies (engine/core/queue_policy.py) change who runs when, never what a request generates."""

import pytest
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.core.request import RequestOptions

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return [o.token_ids for o in LLM(checkpoint=checkpoint, dtype="float32").generate(PROMPTS, GREEDY)]


def test_priority_policy_gives_the_same_greedy_tokens_and_runs_lower_first(checkpoint, reference):
    # Two at a time, so most wait: the queue's order decides who runs when.
    llm = LLM(checkpoint=checkpoint, dtype="float32", scheduling_policy="priority", max_num_seqs=2)
    priority = [len(PROMPTS) - i for i in range(len(PROMPTS))]  # the last prompt first
    finished = []
    requests = [
        llm.engine.add_request(llm.tokenizer.encode(p, add_special_tokens=True), GREEDY, RequestOptions(priority=q))
        for p, q in zip(PROMPTS, priority)
    ]
    while llm.engine.has_unfinished():
        finished += [r.request_id for r in llm.engine.step() if r.status.finished]
    assert [r.output_token_ids for r in requests] == reference
    order = [r.request_id for r in sorted(requests, key=lambda r: r.options.priority)]
    assert finished[:2] != [r.request_id for r in requests[:2]]  # not arrival order: the lowest values went first
    assert set(finished[:2]) == set(order[:2])
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_offline_priority_matches_the_prompts():
    llm_args = {"model": "dummy:tiny", "scheduling_policy": "priority"}
    with pytest.raises(ValueError, match="one priority per prompt"):
        LLM(**llm_args).generate([[1, 2], [3, 4]], GREEDY, priority=[1])


def test_a_length_predictor_file_needs_the_predicted_policy(tmp_path):
    with pytest.raises(ValueError, match="--scheduling-policy predicted"):
        LLM(model="dummy:tiny", length_predictor=str(tmp_path / "length.safetensors"))
