"""torch.compile of the token-wise segments (engine/runner/token_segments.py), on the CPU through Inductor's C++
backend and the graph runners' CPU stand-in: the eager tokens, one compile per segment for every layer and
bucket, the K/V written in place, and the fallback to eager ops when compiling fails. GPU tests run with --gpu."""

import argparse

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine
from engine.model.loader import load_checkpoint
from engine.runner import token_segments
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.decode_graphs import DecodeGraphRunner
from engine.runner.token_segments import EAGER, Segments, pick_segments
from gateway.cli import add_engine_flags, engine_kwargs

CONFIG = EngineConfig(
    model="dummy:tiny",
    device="cpu",
    dtype="float32",
    kv_cache_dtype="float32",  # a GPU's cache holds the compute dtype: the stand-in's too
    max_num_seqs=8,
    max_num_batched_tokens=64,
    kv_cache_memory=2**20,
    max_model_len=256,
)
# Float32 sums in another order and fused multiply-adds: the compiled code's results differ in the last bits.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def compiled():
    """Engines on one dummy:tiny checkpoint: eager, and with both graph runners (CPU stand-in) replaying compiled
    segments; and the counter of Dynamo's compiles. The first compile takes ~10-40 s here, a warm cache a few."""
    torch._dynamo.reset()
    ckpt = load_checkpoint(CONFIG.model)
    eager, graphed = build_engine(CONFIG, ckpt), build_engine(CONFIG, ckpt)
    counter = CompileCounterWithBackend("inductor")
    r = graphed.runner
    segments = pick_segments("on", True, r.model, r.kv_caches, r.scratch_block, backend=counter)
    cpu = torch.device("cpu")
    r.graphs = CudaGraphRunner(r.model, r.kv_caches, 16, r.scratch_block, cpu, torch.float32, segments=segments)
    r.decode_graphs = DecodeGraphRunner(
        r.model, r.kv_caches, r.attention, 8, r.scratch_block, cpu, segments=segments, max_rows=16
    )
    return eager, graphed, counter


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 1000 + 1 for j in range(3 + 5 * i)] for i in range(n)]


def test_compiled_graphs_give_the_eager_greedy_tokens_with_one_compile_per_segment(compiled):
    """Staggered arrivals: steps of up to 16 rows replay whole-step buckets (decodes, and short prompts joining them),
    longer ones the piecewise buckets up to 16 or eagerly. Every layer and bucket reuses the three compiles made before capture."""
    eager, graphed, counter = compiled
    outputs = []
    for engine in (eager, graphed):
        pending, requests = prompts(8), []
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        while pending or engine.has_unfinished():
            if pending:
                requests.append(engine.add_request(pending.pop(0), params))
            engine.step()
        outputs.append([r.output_token_ids for r in requests])
    assert outputs[1] == outputs[0]
    assert counter.frame_count == 3  # enter, between, leave: no recompile for a layer, a bucket, or one token


def test_compiled_segments_match_the_eager_ones_and_write_the_cache_in_place(compiled):
    """One step's segments run eagerly and compiled from the same state: the residual stream, the queries and the
    cache (with this step's K/V in its slots) agree to float32 rounding, and no other slot changes at all."""
    _, graphed, _ = compiled
    r = graphed.runner
    model, compiled_segments = r.model, r.graphs.segments
    layers, s, n = model.layers, model.shape, 5
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    positions = torch.tensor([0, 7, 31, 100, 255])
    slots = torch.tensor([17, 40, 3, 99, 16])  # out of order, across blocks
    attn = torch.randn(n, s.num_heads, s.head_dim, generator=gen)
    cache = torch.randn_like(r.kv_caches[1])
    results = []
    with torch.inference_mode():  # as the runners call them: grad mode is part of what Dynamo guards on
        for segments in (EAGER, compiled_segments):
            x, q, c = torch.zeros(n, s.hidden_size), torch.zeros(n, s.num_heads, s.head_dim), cache.clone()
            segments.enter(model, layers[0], ids, positions, c, slots, x, q)
            segments.between(layers[0], layers[1], x, attn, positions, c, slots, q)
            results.append((x.clone(), q.clone(), c))
            segments.leave(model, layers[-1], x, attn)
            results[-1] += (x,)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **TOLERANCE)
    flat = [c.view(2, s.num_kv_heads, -1, s.head_dim) for c in (cache, results[0][2], results[1][2])]
    untouched = torch.ones(flat[0].shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[2][:, :, untouched], flat[0][:, :, untouched])
    assert not torch.isclose(flat[2][:, :, slots], flat[0][:, :, slots]).any()  # every written value is new


def test_a_failing_compile_falls_back_to_eager_ops_with_a_warning_unless_compile_is_on(compiled):
    _, graphed, _ = compiled
    r = graphed.runner

    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    args = (r.model, r.kv_caches, r.scratch_block)
    with pytest.warns(UserWarning, match="torch.compile of the token-wise segments failed.*no C.. compiler here"):
        assert pick_segments("auto", True, *args, backend=broken) is EAGER
    with pytest.raises(Exception, match="no C.. compiler here"):
        pick_segments("on", True, *args, backend=broken)
    assert pick_segments("off", True, *args) is EAGER


def test_compile_on_needs_graphs_and_auto_compiles_only_where_they_run(compiled, monkeypatch):
    _, graphed, _ = compiled
    r = graphed.runner
    calls = []
    monkeypatch.setattr(token_segments, "compile_segments", lambda *a: calls.append(a) or Segments())
    assert pick_segments("auto", False, r.model, r.kv_caches, r.scratch_block) is EAGER and not calls
    with pytest.raises(ValueError, match="compile=on: the compiled segments run inside the CUDA graphs"):
        pick_segments("on", False, r.model, r.kv_caches, r.scratch_block)  # the CPU, a pipeline stage, a shard
    assert not calls


@pytest.mark.gpu
def test_compiled_graphs_match_eager_tokens_on_gpu():
    """Float32 on a GPU: graphs with Inductor's Triton kernels against eager PyTorch, the same greedy tokens."""
    base = EngineConfig(
        model="dummy:smollm2-135m", device="cuda", dtype="float32", max_num_batched_tokens=256, kv_cache_memory=2**30
    )
    ckpt = load_checkpoint(base.model)
    torch._dynamo.reset()
    outputs = []
    for overrides in ({"enforce_eager": True}, {"compile": "on"}):
        graphs_before = counters["stats"]["unique_graphs"]
        engine = build_engine(base.with_(**overrides), ckpt)
        compiled_here = engine.runner.graphs is not None and engine.runner.graphs.segments is not EAGER
        assert compiled_here == ("compile" in overrides)
        reqs = [
            engine.add_request(
                list(range(5 + 7 * i, 40 + 9 * i)), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            )
            for i in range(8)
        ]
        while engine.has_unfinished():
            engine.step()
        outputs.append([r.output_token_ids for r in reqs])
        # Three compiles (enter, between, leave) for every layer, bucket and both graph runners; none when eager.
        assert counters["stats"]["unique_graphs"] - graphs_before == (3 if "compile" in overrides else 0)
        del engine
        torch.cuda.empty_cache()
    assert outputs[1] == outputs[0]


def test_the_compile_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_kwargs(parser.parse_args(["--compile", "off"])) == {"compile": "off"}
    assert EngineConfig().compile == "auto"
