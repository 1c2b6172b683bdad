"""The CUDA graph runner: buckets, padding, and segment plumbing (CPU stand-in), plus graphs vs eager on a GPU."""

import pytest
import torch
from conftest import run_staggered

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine
from engine.runner.cuda_graphs import CudaGraphRunner, bucket_for, graph_buckets

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "1, 2, 3, 4, 5,",
    "Q: What is 12 * 12?\nA:",
    "In machine learning, a transformer is",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "max_tokens, expected",
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 24]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_buckets_are_powers_of_two_to_8_then_multiples_of_8(max_tokens, expected):
    assert graph_buckets(max_tokens) == expected


def test_buckets_for_the_default_token_budget():
    buckets = graph_buckets(2048)
    assert buckets[:4] == [1, 2, 4, 8]
    assert buckets[4:] == list(range(16, 2049, 8))


def test_bucket_for_pads_up_to_the_smallest_bucket_that_fits():
    buckets = graph_buckets(24)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 24)] == [1, 2, 4, 8, 8, 16, 16, 24, 24]
    assert bucket_for(buckets, 25) is None  # larger than every bucket: the runner goes eager


def test_no_buckets_below_one_token():
    with pytest.raises(ValueError):
        graph_buckets(0)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """An eager engine and one whose runner replays (CPU stand-in) graphs up to 16 tokens, on the same weights."""
    config = EngineConfig(device="cpu", max_num_batched_tokens=64, kv_cache_memory=64 * 737_280)
    eager, graphed = build_engine(config, checkpoint), build_engine(config, checkpoint)
    graphed.runner.graphs = CudaGraphRunner(graphed.model, 16, torch.device("cpu"), torch.float32)
    return eager, graphed


def test_graph_segments_reproduce_the_eager_logits_with_padding(engines, tokenizer):
    eager, graphed = engines
    graphs = graphed.runner.graphs
    graphs.input_ids.random_(0, 1000)  # stale padding rows must not leak into the real ones
    graphs.positions.random_(0, 100)
    prompts = [tokenizer.encode(p)[:n] for p, n in zip(PROMPTS, (4, 4, 3))]  # 11 tokens: padded to 16
    logits = []
    for engine in (eager, graphed):
        for ids in prompts:
            engine.add_request(ids, SamplingParams(max_tokens=1))
        batch = engine.scheduler.schedule()
        assert batch.num_tokens == 11
        logits.append(engine.runner.run(batch))
        for r in batch.requests:
            engine.abort_request(r.request_id)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_greedy_tokens_identical_with_graphs_on_mixed_batches(engines, tokenizer):
    """Staggered arrivals: prefills (eager, over 16 tokens) and decodes (graph buckets) mix in iterations."""
    eager, graphed = engines
    used_buckets = []
    forward = graphed.runner.graphs.forward

    def spy(input_ids, *args):
        out = forward(input_ids, *args)
        used_buckets.append(graphed.runner.graphs.bucket_for(input_ids.shape[0]) if out is not None else None)
        return out

    graphed.runner.graphs.forward = spy
    try:
        outputs = []
        for engine in (eager, graphed):
            requests = run_staggered(engine, [tokenizer.encode(p) for p in PROMPTS], GREEDY)
            outputs.append([r.output_token_ids for r in requests])
    finally:
        del graphed.runner.graphs.forward
    assert outputs[1] == outputs[0]
    assert None in used_buckets  # long prefills ran eager
    assert {1, 2, 4, 8} <= set(used_buckets)  # decodes of 1..6 requests replayed padded buckets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_match_eager_on_gpu():
    base = EngineConfig(model="dummy:smollm2-135m", device="cuda", max_num_batched_tokens=256, kv_cache_memory=2**30)
    from engine.model.loader import load_checkpoint

    ckpt = load_checkpoint(base.model)
    outputs = []
    for enforce_eager in (True, False):
        engine = build_engine(base.with_(enforce_eager=enforce_eager), ckpt)
        assert (engine.runner.graphs is None) == enforce_eager
        reqs = [engine.add_request(list(range(5 + 7 * i, 40 + 9 * i)), GREEDY) for i in range(8)]
        while engine.has_unfinished():
            engine.step()
        outputs.append([r.output_token_ids for r in reqs])
        del engine
        torch.cuda.empty_cache()
    assert outputs[1] == outputs[0]
