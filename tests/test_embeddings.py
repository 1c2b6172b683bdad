"""Embeddings from the engine: a prompt's final normed hidden states pooled (last row, or mean over the prompt)
equal transformers' last hidden state (after the final norm) pooled the same way, for one prompt, a batch of
prompts of different lengths, and a prompt computed in several chunks."""

import pytest
import torch
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.core.batch import Batch, ScheduledRequest
from engine.core.sampling_params import InvalidRequestError
from engine.runner.pooling import Pooler

# float32 inputs to the block matmuls and a float32 KV cache, as the reference computes
EXACT = {"block_activations": "float32", "kv_cache_dtype": "float32"}
TOLERANCE = 1e-5


def params(pooling: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, prompt_only=True, pooling=pooling)


def normalised(v) -> torch.Tensor:
    v = torch.as_tensor(v, dtype=torch.float32)
    return v / v.norm()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    long = " ".join(PROMPTS) * 2  # longer than the chunk budget below
    return [tokenizer.encode(p) for p in PROMPTS[:3]] + [tokenizer.encode(long)]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    """Per prompt: transformers' final hidden states [len, hidden] (the last entry is after the final norm)."""
    with torch.no_grad():
        return [
            hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float() for ids in prompt_ids
        ]


def pooled(ref: torch.Tensor, pooling: str) -> torch.Tensor:
    return normalised(ref[-1] if pooling == "last" else ref.double().mean(dim=0))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, dtype="float32", max_num_batched_tokens=32, **EXACT)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_one_prompt_and_a_batch_equal_transformers(llm, prompt_ids, reference, pooling):
    assert len(prompt_ids[-1]) > 32  # the long prompt runs in several chunks
    alone = llm.generate([prompt_ids[0]], params(pooling))[0]
    assert alone.token_ids == [] and alone.finish_reason == "length"
    assert (normalised(alone.embedding) - pooled(reference[0], pooling)).abs().max().item() < TOLERANCE
    batch = llm.generate(prompt_ids, params(pooling))
    for out, ref in zip(batch, reference):
        assert len(out.embedding) == ref.shape[1]
        assert (normalised(out.embedding) - pooled(ref, pooling)).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_cached_prompt_embeds_the_same(llm, prompt_ids, reference, pooling):
    """A prefix-cache hit would skip rows the mean needs (so mean pooling takes none); the last row is computed
    whatever the cache holds: the second run of the same prompt equals the first."""
    first = llm.generate([prompt_ids[-1]], params(pooling))[0].embedding
    again = llm.generate([prompt_ids[-1]], params(pooling))[0].embedding
    assert (normalised(again) - pooled(reference[-1], pooling)).abs().max().item() < TOLERANCE
    assert (normalised(again) - normalised(first)).abs().max().item() < TOLERANCE


def test_pooling_params_are_checked():
    with pytest.raises(InvalidRequestError, match="pooling must be last or mean"):
        SamplingParams(max_tokens=1, prompt_only=True, pooling="max")
    with pytest.raises(InvalidRequestError, match="pooling needs a prompt-only request"):
        SamplingParams(max_tokens=1, pooling="last")


def test_two_pipeline_stages_give_the_same_embeddings(prompt_ids, reference):
    with LLM(model=None, pipeline_stages=2, dtype="float32", max_num_batched_tokens=32, **EXACT) as llm:
        for pooling in ("last", "mean"):
            for out, ref in zip(llm.generate(prompt_ids, params(pooling)), reference):
                assert (normalised(out.embedding) - pooled(ref, pooling)).abs().max().item() < TOLERANCE


def test_pooler_sums_chunks_restarts_at_zero_and_forgets():
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    other = ScheduledRequest("b", [9], 5, [0], True)  # a decoding request's row comes first in each batch

    def chunk(start: int, last: bool) -> Batch:
        return Batch([other, ScheduledRequest("a", [1, 2, 3], start, [0], last, pooling="mean")])

    pooler = Pooler()
    assert pooler.pool(chunk(0, False), rows[:4]) == {} and set(pooler.sums) == {"a"}
    pooler.pool(chunk(0, False), rows[:4])  # recomputed from position 0 (preempted): the sum starts again
    assert pooler.pool(chunk(3, True), rows[3:]) == {"a": rows[[1, 2, 3, 4, 5, 6]].mean(dim=0).tolist()}
    assert pooler.sums == {}
    pooler.pool(chunk(0, False), rows[:4])
    pooler.forget(["a"])  # released: aborted part-way through its prompt
    assert pooler.sums == {}
    last = Batch([other, ScheduledRequest("a", [1, 2, 3], 0, [0], True, pooling="last")])
    assert pooler.pool(last, rows[:4]) == {"a": rows[3].tolist()}
