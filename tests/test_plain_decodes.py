"""The scheduler's fast path for plain decode rows (engine/core/plain_decodes.py) against its general path: the same
arrivals, aborts and sampled tokens give the same batches, outputs, freed blocks and prefix-cache names."""

import hashlib
import random

import msgspec
import pytest

from engine.core.config import EngineConfig
from engine.core.request import Failure, Request, RequestOptions, SampledTokens, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

BS = 4
EOS = 3


def token_for(rid: str, position: int) -> int:
    """A request's token at an output position: the same whichever batch samples it, stops and eos included."""
    return hashlib.sha256(f"{rid}/{position}".encode()).digest()[0] % 24


def sample(s: Scheduler, batch, rng: random.Random) -> dict:
    """What an executor would return for `batch`: each sampling request's tokens (several for a run of several steps),
    logprobs where asked, and now and then a Failure."""
    out = {}
    for rid in batch.sampling_ids:
        req = s.requests.get(rid)
        if req is None:  # gone since (aborted): its row's token is dropped
            out[rid] = SampledTokens([0])
            continue
        if rng.random() < 0.01:
            out[rid] = Failure("boom")
            continue
        first = len(req.output_token_ids) + req.num_pending_outputs - 1  # the output position this batch samples
        tokens = [token_for(rid, first + k) for k in range(batch.num_steps)]
        logprobs = [TokenLogprobs(t, -1.0, []) for t in tokens] if req.params.logprobs is not None else None
        out[rid] = SampledTokens(tokens, logprobs)
    return out


def run(fast: bool, seed: int, async_scheduling: str, kv_window: int | None, check_in_steps: int) -> dict:
    """Drive one scheduler with the fast path on or off; returns every batch, update and end state, comparable."""
    rng = random.Random(seed)  # the same draws for both: nothing below depends on which path runs
    config = EngineConfig(
        block_size=BS,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
        check_in_steps=check_in_steps,
    )
    s = Scheduler(config, num_blocks=20, max_model_len=64, kv_window=kv_window)
    s.columnar_decode, s.fast_decode = True, fast
    s.kv.record_events()
    trace, in_flight, finished = [], [], {}
    depth = 2 if s.run_ahead else 1
    shared = [rng.randrange(30, 500) for _ in range(3 * BS)]  # a system prompt, so blocks are found and named
    for n in range(2000):
        if n >= 300 and not s.has_unfinished() and not in_flight:
            break
        if n < 300:
            for _ in range(rng.choice([0, 0, 0, 1, 2])):
                prompt = shared[: rng.choice([0, BS, 3 * BS])] + [
                    rng.randrange(30, 500) for _ in range(rng.randrange(1, 20))
                ]
                max_tokens = rng.randrange(1, 50)
                params = SamplingParams(
                    max_tokens=max_tokens,
                    min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
                    stop_token_ids=rng.choice([(), (5,)]),
                    logprobs=rng.choice([None, None, None, 1]),
                )
                salt = rng.choice([b"", b"", b"tenant"])
                rid = f"r{s.num_arrived}"
                s.add(Request(rid, prompt, params, eos_token_id=EOS, options=RequestOptions(cache_salt=salt)))
            if s.requests and rng.random() < 0.03:
                s.abort(rng.choice(sorted(s.requests)))
        batch = s.schedule()
        trace.append(("batch", msgspec.to_builtins(batch), s.num_preemptions))
        if len(batch):
            in_flight.append(batch)
        if in_flight and (len(in_flight) == depth or not len(batch)):
            done = in_flight.pop(0)
            updated = s.update(done, sample(s, done, rng))
            trace.append(("updated", [(r.request_id, list(r.output_token_ids), r.status.value) for r in updated]))
            for r in updated:
                if r.status.finished:
                    finished[r.request_id] = (r.output_token_ids, r.output_logprobs, r.status.value, r.error)
        trace.append(("events", s.kv.drain_events()))
    assert not s.has_unfinished() and not in_flight
    return {
        "trace": trace,
        "finished": finished,
        "free_blocks": s.kv.num_free_blocks,
        "cached": dict(s.kv.cached),
        "preemptions": s.num_preemptions,
    }


@pytest.mark.parametrize(
    "seed, async_scheduling, kv_window, check_in_steps",
    [(0, "on", None, 1), (1, "off", None, 1), (2, "on", 8, 1), (3, "on", None, 4), (4, "off", None, 4)],
)
def test_fast_path_schedules_and_updates_exactly_as_the_general_path(seed, async_scheduling, kv_window, check_in_steps):
    fast = run(True, seed, async_scheduling, kv_window, check_in_steps)
    general = run(False, seed, async_scheduling, kv_window, check_in_steps)
    # What the run went through, so the comparison covers each case.
    statuses = {status for _, _, status, _ in general["finished"].values()}
    assert {"stop", "length", "error"} <= statuses, statuses
    assert general["preemptions"] > 0 and general["cached"]
    for i, (a, b) in enumerate(zip(fast["trace"], general["trace"])):
        assert a == b, f"step record {i} differs"
    assert len(fast["trace"]) == len(general["trace"])
    assert fast["finished"] == general["finished"]
    assert fast["cached"] == general["cached"]  # the same blocks named the same
    assert fast["free_blocks"] == general["free_blocks"] == 20  # every block back


def test_fast_path_takes_the_steady_decode_rows():
    """It is the path that runs: an all-decode step schedules every row through it."""
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=8, async_scheduling="on")
    s = Scheduler(config, num_blocks=64, max_model_len=256)
    s.columnar_decode = True
    for i in range(4):
        s.add(Request(f"r{i}", [10 + i] * 6, SamplingParams(max_tokens=20), eos_token_id=EOS))
    first = s.schedule()
    s.update(first, {rid: SampledTokens([7]) for rid in first.sampling_ids})
    calls = []
    general = s._schedule_running
    s._schedule_running = lambda scheduled, max_seqs, budget, i=0: (
        calls.append(i) or general(scheduled, max_seqs, budget, i)
    )
    batch = s.schedule()
    assert batch.decode.request_ids == ["r0", "r1", "r2", "r3"] and not batch.requests
    assert calls == [4]  # the general path started after every running request
