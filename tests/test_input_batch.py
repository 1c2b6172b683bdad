"""The runner's persistent batch: batches carry only block-table changes, and the rows kept equal a fresh build."""

import random

import numpy as np
import pytest
import torch

from engine.core.batch import Batch, ScheduledRequest
from engine.core.config import EngineConfig
from engine.core.request import Request, SampledTokens
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.runner.input_batch import BlockTableGap, InputBatch

BS = 4


def whole(batch: Batch, s: Scheduler) -> Batch:
    """The same batch with every request's whole table, as a runner that kept nothing needs it."""
    return Batch(
        [
            ScheduledRequest(
                sr.request_id,
                sr.token_ids,
                sr.num_computed_tokens,
                list(s.requests[sr.request_id].block_table),
                sr.sample,
                sr.prompt_logprobs,
                sr.num_draft,
                sr.probe,
            )
            for sr in batch.requests
        ]
        + [
            # A decode row's position, right after the scheduler counted it in flight: the tokens before it.
            ScheduledRequest(
                rid,
                [token],
                s.requests[rid].num_computed_tokens + s.requests[rid].num_in_flight_tokens - 1,
                list(s.requests[rid].block_table),
                True,
            )
            for rid, token in zip(batch.decode.request_ids, batch.decode.token_ids)
        ]
    )


def drive(s: Scheduler, rng: random.Random, on_batch, num_steps: int = 300) -> dict[str, int]:
    """Random arrivals, stops, aborts and (with few blocks) preemptions, two batches in flight; `on_batch` sees each
    batch as it is scheduled. Returns how often each kind of event happened."""
    seen = {"preempted": 0, "aborted": 0, "finished": 0, "grew": 0, "mixed": 0}
    if s.columnar_decode:
        seen.update(columns=0, moved=0)
    in_flight: list[Batch] = []
    depth = 2 if s.run_ahead else 1
    n = 0
    for _ in range(num_steps):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(max_tokens=rng.randrange(1, 60))
            s.add(Request(f"r{n % 40}" if f"r{n % 40}" not in s.requests else f"x{n}", prompt, params, eos_token_id=3))
            n += 1
        if s.requests and rng.random() < 0.05:
            s.abort(rng.choice(sorted(s.requests)))
            seen["aborted"] += 1
        preemptions = s.num_preemptions
        batch = s.schedule()
        seen["preempted"] += s.num_preemptions - preemptions
        if len(batch):
            seen["grew"] += sum(bool(sr.block_table) and sr.block_offset > 0 for sr in batch.requests)
            seen["mixed"] += len({len(sr.token_ids) == 1 for sr in batch.requests}) == 2
            if s.columnar_decode:
                seen["mixed"] += bool(batch.requests and batch.decode.request_ids)
                seen["columns"] += len(batch.decode)
                seen["moved"] += len(batch.decode.moved)
                seen["grew"] += sum(offset > 0 for offset in batch.decode.block_offsets)
            on_batch(batch)
            in_flight.append(batch)
        if in_flight and (len(in_flight) == depth or not len(batch)):
            done = in_flight.pop(0)
            tokens = {rid: SampledTokens([rng.choice([3, 5, 8, 13])]) for rid in done.sampling_ids}
            seen["finished"] += sum(r.status.finished for r in s.update(done, tokens))
    return seen


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_rows_kept_between_batches_equal_each_requests_whole_table(async_scheduling):
    rng = random.Random(0)
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=async_scheduling)
    s = Scheduler(config, num_blocks=24, max_model_len=128)
    kept = InputBatch(max_blocks=128 // BS, capacity=2)  # it grows as it must

    def check(batch: Batch) -> None:
        rows = kept.apply(batch)
        tables, width = kept.gather(rows)
        fresh = [s.requests[sr.request_id].block_table for sr in batch.requests]
        assert width == max(map(len, fresh))
        expected = np.array([t + [0] * (width - len(t)) for t in fresh], dtype=np.int32)
        np.testing.assert_array_equal(tables, expected)
        # A row no live request holds is all zeros, and every live request holds one row.
        assert set(kept.rows) <= set(s.requests) | set(s.dropped)
        live = list(kept.rows.values())
        assert len(set(live)) == len(live)
        free = np.ones(len(kept.lengths), dtype=bool)
        free[live] = False
        assert not kept.block_tables[free].any() and not kept.num_blocks[free].any()

    seen = drive(s, rng, check)
    assert all(seen.values()), seen  # every kind of change happened


def test_a_batch_whose_blocks_follow_ones_never_received_is_refused():
    kept = InputBatch(max_blocks=8)
    kept.apply(Batch([ScheduledRequest("a", [1], 0, [4, 5], True)]))
    with pytest.raises(BlockTableGap, match="from 3 on, this runner holds 2"):
        kept.apply(Batch([ScheduledRequest("a", [1], 5, [6], True, block_offset=3)]))
    with pytest.raises(BlockTableGap, match="from 1 on, this runner holds 0"):
        kept.apply(Batch([ScheduledRequest("b", [1], 5, [6], True, block_offset=1)]))


@pytest.fixture(scope="module")
def engine():
    from engine.launch import build_engine

    config = EngineConfig(
        model="dummy:tiny",
        device="cpu",
        block_size=BS,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculative="off",
        kv_cache_memory=2**22,
        async_scheduling="on",
    )
    return build_engine(config)


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_prepare_from_kept_rows_equals_a_fresh_prepare_of_whole_tables(engine, async_scheduling):
    """Every input a runner that kept its rows prepares equals, exactly, what one that kept nothing prepares from
    whole tables, through arrivals, prefills mixed with decodes, stops, aborts and preemptions."""
    from engine.runner.model_runner import ModelRunner

    runner = engine.runner
    s = Scheduler(engine.config.with_(async_scheduling=async_scheduling), num_blocks=24, max_model_len=128)
    fresh = ModelRunner(engine.config, runner.model, 24, 128)
    previous = (torch.arange(100, 100 + engine.config.max_num_seqs), {})

    def check(batch: Batch) -> None:
        sources = {sr.request_id: i for i, sr in enumerate(batch.requests)}
        got = runner.prepare(batch, (previous[0], sources))
        fresh.input_batch = InputBatch(fresh.input_batch.max_blocks)
        want = fresh.prepare(whole(batch, s), (previous[0], sources))
        for a, b in zip(got[:2] + got[3:], want[:2] + want[3:]):
            assert torch.equal(a, b)
        for field in ("query_start_loc", "context_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(got[2], field), getattr(want[2], field)), field
        assert got[2].query_lens_cpu == want[2].query_lens_cpu
        assert got[2].context_lens_cpu == want[2].context_lens_cpu

    seen = drive(s, random.Random(0), check)
    assert all(seen.values()), seen


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_decode_columns_and_kept_positions_equal_a_fresh_prepare(engine, async_scheduling):
    """With plain decode rows as columns (Batch.decode: positions only where they moved, blocks only where new), the
    runner's kept rows, positions and tokens prepare exactly what a runner that kept nothing prepares from every row's
    whole state, through arrivals, prefills mixed with decodes, stops, aborts and preemptions."""
    from engine.runner.model_runner import ModelRunner

    s = Scheduler(engine.config.with_(async_scheduling=async_scheduling), num_blocks=24, max_model_len=128)
    s.columnar_decode = True
    kept = ModelRunner(engine.config, engine.runner.model, 24, 128)
    kept.input_batch = InputBatch(kept.input_batch.max_blocks, capacity=2)  # it grows as it must
    fresh = ModelRunner(engine.config, engine.runner.model, 24, 128)
    previous = torch.arange(100, 100 + engine.config.max_num_seqs)

    def check(batch: Batch) -> None:
        sources = {rid: i for i, rid in enumerate(batch.request_ids)}
        want_batch = whole(batch, s)  # before prepare: read from the scheduler as it scheduled the batch
        got = kept.prepare(batch, (previous, sources))
        fresh.input_batch = InputBatch(fresh.input_batch.max_blocks)
        want = fresh.prepare(want_batch, (previous, sources))
        for name, a, b in zip(("input_ids", "positions", "logits_indices"), got[:2] + got[3:], want[:2] + want[3:]):
            assert torch.equal(a, b), name
        for field in ("query_start_loc", "context_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(got[2], field), getattr(want[2], field)), field
        assert got[2].query_lens_cpu == want[2].query_lens_cpu
        assert got[2].context_lens_cpu == want[2].context_lens_cpu
        # Every live row's next position is right after the row it last had; a free row holds none.
        rows = kept.input_batch
        for sr in want_batch.requests:
            assert rows.next_positions[rows.rows[sr.request_id]] == sr.num_computed_tokens + len(sr.token_ids)
        free = np.ones(len(rows.lengths), dtype=bool)
        free[list(rows.rows.values())] = False
        assert (rows.next_positions[free] == -1).all()

    seen = drive(s, random.Random(3), check)  # a seed whose run moves a row (a preempted request back)
    assert all(seen.values()), seen
