"""Length-aware scheduling (issue 31): the length predictor, and the `predicted` policy's order, bound and tokens."""

import argparse
import math
import random

import pytest
from conftest import PROMPTS, ByHidden, decode_ready

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.queue_policy import Predicted, policy_name, queue_policy
from engine.core.request import Request, RequestOptions, RequestStatus, SampledTokens
from engine.core.scheduler import Scheduler
from engine.ipc.messages import EngineStats
from engine.model.length_predictor import RidgeLengthPredictor
from gateway.cli import add_engine_flags
from gateway.web.metrics import Metrics

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


# ------------------------------------------------------------------------------------------------- the predictor


def synthetic(rng: random.Random, length: int, size: int = 8) -> list[float]:
    """A hidden state whose first coordinate carries log(length), the rest noise."""
    return [math.log1p(length) + rng.gauss(0, 0.1)] + [rng.gauss(0, 1) for _ in range(size - 1)]


def test_the_predictor_says_nothing_until_it_has_learnt_then_ranks_lengths(tmp_path):
    rng = random.Random(0)
    p = RidgeLengthPredictor(8, str(tmp_path / "length.safetensors"))
    for i in range(p.MIN_REQUESTS - 1):
        length = rng.choice([2, 20, 200])
        p.observe([(0, synthetic(rng, length))], length)
        assert p.predict(synthetic(rng, 5), 0) is None
    for _ in range(2 * p.REFIT_EVERY):
        length = rng.choice([2, 20, 200])
        p.observe([(0, synthetic(rng, length)), (length // 2, synthetic(rng, length - length // 2))], length)
    short, middle, long = (p.predict(synthetic(rng, n), 0) for n in (2, 20, 200))
    assert short < middle < long
    assert 10 < middle < 40  # log-space regression: the scale is right too


def test_the_predictor_keeps_what_it_learnt_in_its_file(tmp_path):
    path = str(tmp_path / "length.safetensors")
    rng = random.Random(1)
    p = RidgeLengthPredictor(8, path)
    for _ in range(p.SAVE_EVERY):
        length = rng.choice([3, 300])
        p.observe([(0, synthetic(rng, length))], length)
    probe = synthetic(rng, 30)
    again = RidgeLengthPredictor(8, path)
    assert again.num_requests == p.SAVE_EVERY
    assert again.predict(probe, 0) == pytest.approx(p.predict(probe, 0), rel=1e-9)
    with pytest.raises(ValueError, match="hidden size 8"):
        RidgeLengthPredictor(16, path)


# ------------------------------------------------------------------------------------- the policy, on the scheduler


def make(**cfg) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_batched_tokens=256, scheduling_policy="predicted", **cfg)
    return Scheduler(config, 4096, max_model_len=4096, policy=Predicted(ByHidden()))


def test_a_stream_of_short_requests_overtakes_a_long_one_only_within_its_aging_bound():
    """One request of 1000 tokens, then a short one (4 tokens) arriving every 0.1 s (an iteration), one slot an
    iteration: more work arrives than runs. Short ones go first, but only those that arrived within 1000 / AGING
    seconds of the long one: after that it runs, and finishes, while they keep coming."""
    s = make(max_num_seqs=1)
    length = {"long": 1000}
    long = Request("long", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True), arrival_time=0.0)
    s.add(long)
    overtook, step, arrivals = None, 0, {}
    while long.status != RequestStatus.FINISHED_LENGTH:
        step += 1
        rid = f"short{step}"
        arrivals[rid], length[rid] = step * 0.1, 4
        s.add(Request(rid, [5, step % 50 + 10], SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=step * 0.1))
        batch = s.schedule()
        s.update(
            batch,
            {
                r.request_id: SampledTokens([7], hidden=[float(length[r.request_id])] if r.probe else None)
                for r in batch.requests
                if r.sample
            },
        )
        if overtook is None and long.num_output_tokens > 1:  # its first decode
            overtook = [r for r in arrivals if r not in s.requests]
        assert step < 20000
    bound = 1000 / Predicted.AGING
    assert len(overtook) > 100  # shortest first: a short request's 4 tokens before the long one's 1000
    assert max(arrivals[r] for r in overtook) <= bound + 0.1  # but none that came after its bound
    assert len(s.requests) > 1000  # the stream kept coming while it finished


def test_newcomers_take_slots_from_predicted_long_running_requests():
    s = make(max_num_seqs=2)
    for rid, n in [("long1", 500), ("long2", 500)]:
        s.add(Request(rid, [1, 2, 3, len(rid)], SamplingParams(max_tokens=500, ignore_eos=True), arrival_time=0.0))
    batch = s.schedule()
    s.update(batch, {r.request_id: SampledTokens([7], hidden=[500.0]) for r in batch.requests})
    s.add(Request("short", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=1.0))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["short"]  # its prompt alone: its first token waits for no decode
    s.update(batch, {"short": SampledTokens([7], hidden=[3.0])})
    batch = s.schedule()
    assert sorted(r.request_id for r in batch.requests) == ["long1", "short"]  # 2 slots: the newcomer takes one
    assert len(s.running) == 3  # all three hold blocks


def test_new_prompts_run_alone_but_never_twice_in_a_row():
    s = make(max_num_seqs=64)
    decode_ready(s, {"a": 500, "b": 500})
    for step in range(6):
        s.add(
            Request(
                f"new{step}", [9, step + 10], SamplingParams(max_tokens=500, ignore_eos=True), arrival_time=float(step)
            )
        )
        batch = s.schedule()
        ids = sorted(r.request_id for r in batch.requests)
        if step % 2 == 0:
            assert ids == [f"new{step}"]  # its prompt alone
        else:  # the next iteration decodes everyone, this newcomer's prompt with them
            assert {"a", "b", f"new{step}", f"new{step - 1}"} <= set(ids)
        s.update(
            batch,
            {r.request_id: SampledTokens([7], hidden=[500.0] if r.probe else None) for r in batch.requests if r.sample},
        )


def test_a_newcomer_short_of_blocks_takes_them_from_a_predicted_long_request_only():
    config = EngineConfig(block_size=4, max_num_batched_tokens=256, scheduling_policy="predicted", max_num_seqs=4)
    s = Scheduler(config, 6, max_model_len=4096, policy=Predicted(ByHidden()))
    long = Request("long", list(range(1, 17)), SamplingParams(max_tokens=500, ignore_eos=True), arrival_time=0.0)
    s.add(long)
    batch = s.schedule()  # 4 of the 6 blocks
    s.update(batch, {"long": SampledTokens([7], hidden=[500.0])})  # its key: 0 s + 499 tokens / AGING
    late = Request(
        "late",
        list(range(30, 42)),
        SamplingParams(max_tokens=5, ignore_eos=True),
        arrival_time=2 * 500 / Predicted.AGING,
    )
    s.add(late)  # 3 blocks, 2 free: it keys after long, so it waits
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["long"] and late.status == RequestStatus.WAITING
    s.update(batch, {"long": SampledTokens([7])})
    soon = Request("soon", list(range(50, 62)), SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=1.0)
    s.add(soon)  # keys before long: long gives up its blocks for it
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["soon"]
    assert long.status == RequestStatus.WAITING and long.num_preemptions == 1


def probed_step(s: Scheduler) -> list[tuple[str, int]]:
    """One fake iteration, every probe predicting 500 outputs; returns each row's (request, tokens)."""
    batch = s.schedule()
    s.update(
        batch,
        {r.request_id: SampledTokens([7], hidden=[500.0] if r.probe else None) for r in batch.requests if r.sample},
    )
    return [(r.request_id, len(r.token_ids)) for r in batch.requests]


def test_a_newcomer_waiting_for_a_block_being_computed_leaves_its_slot_to_the_request_computing_it():
    """A request preempted and recomputing its prompt (its cached blocks evicted) keys after a newcomer that shares the
    prompt; the newcomer waits for the block the preempted one computes, so that one must run in the slot kept for
    the newcomer, or neither ever runs again."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=4, scheduling_policy="predicted", max_num_seqs=1)
    s = Scheduler(config, 5, max_model_len=4096, policy=Predicted(ByHidden()))
    long = Request("long", list(range(1, 9)), SamplingParams(max_tokens=12, ignore_eos=True), arrival_time=0.0)
    s.add(long)
    assert [probed_step(s) for _ in range(3)] == [[("long", 4)], [("long", 4)], [("long", 1)]]  # 11 to go: key 0.22 s
    s.add(Request("x", list(range(20, 39)), SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.01))
    # x keys first and takes every block (long's named ones evicted); then long computes its prompt again.
    assert [probed_step(s) for _ in range(6)] == [[("x", 4)]] * 4 + [[("x", 3)], [("long", 4)]]
    assert long.num_preemptions == 1 and long.num_computed_tokens == 4  # nothing of it was left in the cache
    s.add(Request("n", list(range(1, 9)) + [50], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.02))
    assert probed_step(s) == [("long", 4)]  # n keys first but waits for long's second block: long runs in its slot
    assert probed_step(s) == [("n", 1)]  # n takes both blocks from the cache
    for _ in range(50):
        probed_step(s)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 5


def test_request_level_admission_under_the_predicted_order_lets_the_running_request_finish():
    """Request-level batching admits nobody while a request runs: the slot kept for a newcomer that keys before the
    running request goes back to it."""
    config = EngineConfig(
        block_size=4, max_num_batched_tokens=256, scheduling_policy="predicted", max_num_seqs=1, scheduling="request"
    )
    s = Scheduler(config, 64, max_model_len=4096, policy=Predicted(ByHidden()))
    s.add(Request("long", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=0.0))
    assert probed_step(s) == [("long", 3)]  # its key: 0 s + 4 tokens / AGING
    s.add(Request("short", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.01))
    assert [probed_step(s) for _ in range(5)] == [[("long", 1)]] * 4 + [[("short", 2)]]
    for _ in range(3):
        probed_step(s)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_finished_requests_report_their_prediction_error_and_pool():
    s = make(max_num_seqs=4)
    for rid, predicted, real in [("a", 10.0, 5), ("b", 200.0, 100)]:
        s.add(Request(rid, [1, len(rid)], SamplingParams(max_tokens=real, ignore_eos=True), arrival_time=0.0))
    while s.has_unfinished():
        batch = s.schedule()
        s.update(
            batch,
            {
                r.request_id: SampledTokens([7], hidden=[{"a": 10.0, "b": 200.0}[r.request_id]] if r.probe else None)
                for r in batch.requests
                if r.sample
            },
        )
    outcomes = sorted(s.policy.drain_length_outcomes())
    assert [(ratio, pool) for ratio, pool, _ in outcomes] == [(2.0, "long"), (2.0, "short")]
    assert s.policy.drain_length_outcomes() == []
    m = Metrics()
    m.observe_stats(EngineStats(0, 0, 0, 0, 1, 0, length_outcomes=outcomes), replica=1)
    text = m.render().decode()
    assert 'orcinus_length_prediction_ratio_bucket{le="2.0",replica="1"} 2.0' in text
    assert 'orcinus_length_prediction_ratio_bucket{le="1.25",replica="1"} 0.0' in text
    assert 'orcinus_request_queue_time_by_pool_seconds_count{pool="short",replica="1"} 1.0' in text


def test_the_oracle_is_a_benchmarks_policy_found_by_its_name_and_the_old_name_still_works():
    """bench/serving/length_oracle.py registers it; `oracle`, the CLI's name for it before, resolves to it."""
    from bench.serving.length_oracle import NAME, Oracle

    assert queue_policy(NAME) is Oracle and policy_name("oracle") == NAME
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        policy_name("shortest")
    flags = argparse.ArgumentParser()
    add_engine_flags(flags)
    assert flags.parse_args(["--scheduling-policy", "oracle"]).scheduling_policy == NAME
    s = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=256, scheduling_policy=NAME), 4096, 4096)
    for rid, length in [("long", 300), ("short", 3)]:  # the true output length rides in `priority`
        s.add(
            Request(
                rid, [1, 2], SamplingParams(max_tokens=500), arrival_time=0.0, options=RequestOptions(priority=length)
            )
        )
    assert isinstance(s.policy, Oracle) and [r.request_id for r in s.waiting] == ["short", "long"]


def null_runs(*runs):
    """bench_length_aware --null-model's open_loop per (policy, arrivals), one step cost, a few KV blocks."""
    from bench.serving import length_null
    from engine.core import engine_core
    from engine.core import scheduler as scheduler_module

    with pytest.MonkeyPatch.context() as mp:
        for module in (engine_core, scheduler_module):  # NullEngine swaps in its clock: theirs back afterwards
            mp.setattr(module, "time", module.time)
        cost = length_null.StepCost(fixed_ms=6.0, decode_row_ms=2.5, prompt_token_ms=1.4)
        return [length_null.open_loop(p, arrivals, 0, num_blocks=8, cost=cost, max_num_seqs=2) for p, arrivals in runs]


def test_the_null_model_runs_decode_each_request_to_its_length():
    short = {"prompt_tokens": 5, "output_tokens": 3, "max_tokens": 8, "predicted": 3.0}
    long = {"prompt_tokens": 9, "output_tokens": 6, "max_tokens": 8, "predicted": 6.0}
    alone, both = null_runs(("fcfs", [(0.0, short)]), ("predicted", [(0.0, long), (0.0, short)]))
    assert alone["requests"] == 1 and alone["output_tok_s"] * alone["elapsed_s"] == pytest.approx(3)
    assert both["requests"] == 2 and both["output_tok_s"] * both["elapsed_s"] == pytest.approx(9)


def test_the_null_model_runs_cost_each_decode_row():
    row = {"prompt_tokens": 5, "output_tokens": 3, "max_tokens": 8, "predicted": 3.0}
    (alone,) = null_runs(("fcfs", [(0.0, row)]))
    # Its prompt's step (6 + 5 x 1.4 ms), then two decodes of one row each (6 + 2.5 ms).
    assert alone["ttft_mean_s"] == pytest.approx(0.013)
    assert alone["elapsed_s"] == pytest.approx(0.030) == alone["alone_e2e_mean_s"]


# ------------------------------------------------------------------------------------------- the engine's tokens


@pytest.fixture(scope="module")
def reference(checkpoint):
    return [
        o.token_ids
        for o in LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32").generate(PROMPTS, GREEDY)
    ]


class Scrambled(ByHidden):
    """An arbitrary but fixed order: a prediction from the hidden state's bits."""

    def __init__(self):
        self.num_probes = 0

    def predict(self, hidden, num_output_tokens):
        self.num_probes += 1
        return float(int(abs(hidden[0]) * 1e4) % 97)


def test_predicted_order_keeps_greedy_tokens_and_frees_every_block(checkpoint, reference):
    llm = LLM(
        checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", scheduling_policy="predicted", max_num_seqs=2
    )
    llm.engine.scheduler.policy.predictor = Scrambled()
    tokens = [llm.engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    requests = []
    for ids in tokens:  # one arrival per iteration
        requests.append(llm.engine.add_request(ids, GREEDY))
        llm.engine.step()
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_token_ids for r in requests] == reference
    assert all(r.length.probes and r.length.predicted is not None for r in requests)
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_predicted_order_with_shared_prefixes_preemption_and_an_abort(checkpoint):
    """Few KV blocks (preemptions), every prompt twice (the second finds the first's blocks), one aborted mid-way:
    the others' greedy tokens are FCFS's, and every block and every sampling state is given back."""
    prompts = [f"{a} {b}" for a, b in zip(PROMPTS[:4], PROMPTS[4:8])] * 2  # 2+ full blocks of 16 tokens each
    want = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32").generate(prompts, GREEDY)
    llm = LLM(
        checkpoint=checkpoint,
        dtype="float32",
        kv_cache_dtype="float32",
        scheduling_policy="predicted",
        max_num_seqs=3,
        kv_cache_memory=8 * 737_280,
    )  # 8 blocks of 16 tokens (737,280 bytes each): 6 requests need 18+
    llm.engine.scheduler.policy.predictor = Scrambled()
    requests = [
        llm.engine.add_request(llm.engine.tokenizer.encode(p, add_special_tokens=True), GREEDY) for p in prompts
    ]
    victim = requests[5]
    while llm.engine.has_unfinished():
        llm.engine.step()
        if victim.num_output_tokens >= 3 and not victim.status.finished:
            llm.engine.abort_request(victim.request_id)
    assert victim.finish_reason == "abort"
    kept = [i for i, r in enumerate(requests) if r is not victim]
    assert [requests[i].output_token_ids for i in kept] == [want[i].token_ids for i in kept]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.prefix_hit_tokens > 0
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    assert llm.engine.executor.sampler.states == {}


def test_pipeline_stages_send_the_probes_back():
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9], [10, 11, 10, 11, 10, 11], [12] * 20]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = LLM(model="dummy:tiny", dtype="float32", kv_cache_dtype="float32").generate(prompts, params)
    with LLM(
        model="dummy:tiny",
        dtype="float32",
        kv_cache_dtype="float32",
        scheduling_policy="predicted",
        max_num_seqs=2,
        pipeline_stages=2,
    ) as llm:
        predictor = llm.engine.scheduler.policy.predictor = Scrambled()
        got = llm.generate(prompts, params)
        assert predictor.num_probes >= 4 * 3  # at each prompt's end and every 16 outputs: from the last stage
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
