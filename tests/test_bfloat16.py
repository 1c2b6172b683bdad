"""bfloat16 on the CPU (`--dtype bfloat16`: the file's blocks with bfloat16 activations, or dense bfloat16 weights)
against the float32 model on the bundled model: teacher-forced logits stay within a stated bound, and the greedy choice
is the same wherever float32's top-1/top-2 margin is clear. (The CPU default is float32: tests/test_fidelity.py.)"""

import pytest
import torch
from conftest import PROMPTS

from engine import LLM, SamplingParams

# Measured on the bundled SmolLM2 over 12 prompts x 24 greedy tokens, with the earlier bfloat16 weights: mean |diff|
# 0.18 per sequence (max 2.8 in the tails of the vocabulary), float32's top token's log-probability moved by at most
# 0.28, and the 7 flipped choices all had float32 margins under 0.35. (Not re-measured for the block weights, whose
# only rounding is the activations'; both variants pass.)
MEAN_ABS_DIFF = 0.3  # logits, averaged over the vocabulary and the positions of one sequence
TOP1_LOGPROB_DIFF = 0.5  # nats: float32's best token keeps about its probability
CLEAR_MARGIN = 0.5  # where float32's best beats its second by this much, bfloat16 must pick it too
# Teacher forcing computes every position in one prefill: no prompt may start from cached blocks.
NO_CACHE = {"prefix_caching": False}


@pytest.fixture(scope="module")
def fp32(checkpoint):
    """Per prompt: its ids with float32's greedy continuation, and float32's teacher-forced logits over them."""
    llm = LLM(checkpoint=checkpoint, dtype="float32", weights="dense", **NO_CACHE)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sequences = [out.prompt_token_ids + out.token_ids for out in llm.generate(PROMPTS, greedy)]
    return [(ids, teacher_forced_logits(llm, ids)) for ids in sequences]


# "gguf": the file's blocks (the float32 weights exactly), activations in bfloat16; "dense": bfloat16 weights too.
VARIANTS = {"gguf": {"dtype": "bfloat16"}, "dense": {"dtype": "bfloat16", "weights": "dense"}}


def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] for every position of one whole-sequence prefill."""
    engine = llm.engine
    req = engine.add_request(ids, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    input_ids, positions, meta, _ = engine.runner.prepare(batch)
    with torch.inference_mode():
        logits = engine.model(
            input_ids, positions, engine.runner.kv_caches, meta, engine.runner.attention, torch.arange(len(ids))
        )
    engine.abort_request(req.request_id)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return logits.float()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bfloat16_logits_stay_close_to_float32_and_keep_every_clear_greedy_choice(checkpoint, fp32, variant):
    bf16 = LLM(checkpoint=checkpoint, **VARIANTS[variant], **NO_CACHE)
    clear = agreed = 0
    for ids, want in fp32:
        got = teacher_forced_logits(bf16, ids)
        assert (got - want).abs().mean().item() < MEAN_ABS_DIFF
        top2 = want.topk(2, dim=-1)
        top1 = top2.indices[:, :1]
        moved = got.log_softmax(-1).gather(1, top1) - want.log_softmax(-1).gather(1, top1)
        assert moved.abs().max() < TOP1_LOGPROB_DIFF
        margin_clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
        clear += margin_clear.sum().item()
        agreed += (got.argmax(-1) == top2.indices[:, 0])[margin_clear].sum().item()
    assert clear > 200 and agreed == clear
