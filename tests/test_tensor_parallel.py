"""Tensor parallelism over torch.distributed (gloo on CPU): each weight's shards put back together are the whole
weight; TP=2, TP=2 x PP=2 and (on the bundled model) TP=3 give greedy tokens identical to one process under
staggered arrivals; a model that cannot split is refused up front; a killed rank under the server ends its
streams with an error and the engine comes back."""

import pytest
import torch
from conftest import PROMPTS
from conftest import run_staggered as run_arrivals
from test_pipeline import kill_a_rank_mid_stream_then_recover

from engine import LLM, SamplingParams
from engine.core.config import DUMMY_SHAPES, ModelShape
from engine.model.families.llama import LlamaModel
from engine.model.sharding import TensorParallelError, TensorShard, check_splittable
from engine.parallel import pipeline
from engine.parallel.frames import StageBatch

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TINY = "dummy:tiny"  # 4 heads, 2 KV heads: splits 2 ways (the bundled SmolLM2's 9 and 3 heads split only 3 ways)
TINY_PROMPTS = [[1000 + 37 * i + j for j in range(3 + 5 * i)] for i in range(12)]


def test_shards_put_back_together_are_the_whole_weights():
    shape = ModelShape(
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        qkv_bias=True,
    )
    with torch.device("meta"):
        names = {n: p.shape for n, p in LlamaModel(shape, 8).named_parameters(remove_duplicate=False)}
    for name, size in names.items():
        full = torch.randn(size)
        shards = [TensorShard(r, 2).take(name, full, shape) for r in range(2)]
        if name.endswith("norm.weight"):
            assert all(torch.equal(s, full) for s in shards)
        elif name in ("embed_tokens.weight", "lm_head.weight"):  # 101 rows: 51 each, the last padded with zeros
            assert [s.shape[0] for s in shards] == [51, 51] and torch.equal(shards[1][50], torch.zeros(16))
            assert torch.equal(torch.cat(shards)[:101], full)
        elif "qkv_proj" in name:  # each rank: its 2 query heads, then its K head, then its V head
            q, k, v = full.split([16, 8, 8])
            parts = [s.split([8, 4, 4]) for s in shards]
            for whole, i in ((q, 0), (k, 1), (v, 2)):
                assert torch.equal(torch.cat([p[i] for p in parts]), whole)
        elif "gate_up_proj" in name:
            gate, up = full.chunk(2)
            assert torch.equal(torch.cat([s.chunk(2)[0] for s in shards]), gate)
            assert torch.equal(torch.cat([s.chunk(2)[1] for s in shards]), up)
        else:  # o_proj, down_proj: row-parallel, split along their inputs
            assert torch.equal(torch.cat(shards, dim=1), full), name


def test_a_model_that_cannot_split_is_refused_before_any_process_starts():
    with pytest.raises(
        TensorParallelError,
        match=r"--tensor-parallel-size 2 must divide the model's attention "
        r"heads \(9\), KV heads \(3\)",
    ):
        check_splittable(ModelShape(), 2)
    check_splittable(ModelShape(), 3)
    with pytest.raises(TensorParallelError, match="KV heads"):
        LLM(model=TINY, tensor_parallel_size=4, dtype="float32")  # 4 query heads but only 2 KV heads
    assert DUMMY_SHAPES["tiny"].num_heads % 2 == 0


@pytest.fixture(scope="module")
def tiny_reference():
    return [r.output_token_ids for r in run_arrivals(LLM(model=TINY, dtype="float32").engine, TINY_PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "grid", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "pipeline_stages": 2}], ids=["tp2", "tp2xpp2"]
)
def test_tensor_parallel_ranks_give_the_same_tokens(grid, tiny_reference, monkeypatch):
    sent = []  # (rank, frame) of every batch the driver sends
    real_send = pipeline.send_frame
    monkeypatch.setattr(
        pipeline,
        "send_frame",
        lambda frame, rank, pending: (
            sent.append((rank, frame)) if isinstance(frame, StageBatch) else None,
            real_send(frame, rank, pending),
        ),
    )
    with LLM(model=TINY, dtype="float32", **grid) as llm:
        executor = llm.engine.executor
        assert len(executor.procs) == grid["tensor_parallel_size"] * grid.get("pipeline_stages", 1)
        got = [r.output_token_ids for r in run_arrivals(llm.engine, TINY_PROMPTS, GREEDY)]
    assert got == tiny_reference
    # Per-request sampling state goes to the sampling rank alone, every request once.
    sampler = [f for rank, f in sent if rank == executor.last_rank]
    sampled = {rid for f in sampler for rid in f.batch.sampling_ids}
    assert sorted(s.request_id for f in sampler for s in f.new_requests) == sorted(sampled)
    assert len(sampled) == len(TINY_PROMPTS)
    assert all(not f.new_requests and not f.released for rank, f in sent if rank != executor.last_rank)
    assert len(sent) == len(sampler) * len(executor.ranks)


def test_the_bundled_model_split_three_ways_gives_the_same_tokens(checkpoint, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    one_process = LLM(checkpoint=checkpoint, dtype="float32").engine
    want = [r.output_token_ids for r in run_arrivals(one_process, prompts, GREEDY)]
    with LLM(tensor_parallel_size=3, dtype="float32") as llm:
        got = [r.output_token_ids for r in run_arrivals(llm.engine, prompts, GREEDY)]
    assert got == want


def test_killing_a_rank_under_the_server_gives_errors_then_503_then_recovers(server_factory):
    with server_factory("--model", TINY, "--tensor-parallel-size", "2") as url:
        kill_a_rank_mid_stream_then_recover(url, num_ranks=2)
