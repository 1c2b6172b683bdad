"""The fidelity budget of the served defaults: what `orcinus serve` runs (LLM() with no overrides, and the thread count
serving sets) gives the float32 model's greedy tokens on the bundled model, alone and inside a batch of 32.

The reference is the float32 model as transformers computes it: the GGUF dequantized to float32 weights (gguf's own
dequantization), float32 activations, PyTorch's ops (`dtype="float32", weights="dense"`). The defaults may differ from
it in the order of float32 sums and in rounding the block matmuls' inputs to int16 per 32 (at most 2^-16 of a
block's largest), so a greedy choice may flip only where float32's two best tokens are all but tied.
Every prompt is compared token by token up to its first divergence; there, float32's margin between its top two
logits must be under MARGIN_BOUND.
"""

from dataclasses import fields

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.ipc.engine_loop import serving_config
from tests.conftest import PROMPTS

# 0.1 nats: float32 sums in another order move a logit by ~1e-5 here; a choice whose margin is 10^4 times that is no
# near-tie, while a real loss of precision shows up well above it. On this set, in a batch of 32: bfloat16 activations
# on these same weights (`--dtype bfloat16`) kept 13 of 32 prompts, flipping choices with float32 margins of 0.31,
# 0.15, 0.13, 0.11 and 0.11 nats (and 14 below 0.1); the previous defaults (bfloat16, int4 copies, a per-row 8-bit
# head) kept 18 (14 alone), with margins up to 0.31. The defaults now keep all 32, alone and in the batch.
MARGIN_BOUND = 0.1
NUM_TOKENS = 32
PROMPT_SET = PROMPTS + [
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "SELECT name, age FROM users WHERE",
    "The French Revolution began in the year",
    "Photosynthesis is the process by which",
    "Here is a recipe for pancakes:\n1.",
    "The best way to learn a new language is",
    "for i in range(10):\n    print(",
    "Dear Sir or Madam,\nI am writing to",
    "The human heart has four chambers:",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "Monday, Tuesday, Wednesday,",
    "A list of prime numbers: 2, 3, 5, 7,",
    "The moon orbits the Earth every",
    "Shakespeare wrote many plays, including",
    "<|im_start|>user\nGive me three tips for better sleep.<|im_end|>\n<|im_start|>assistant\n",
    "The chemical symbol for gold is",
    "In the beginning, the universe was",
]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def served_defaults() -> dict:
    """The EngineConfig fields `orcinus serve` runs with and no flags, as LLM keyword arguments."""
    config = serving_config(EngineConfig())
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name != "model"}


@pytest.fixture(scope="module")
def float32_model(checkpoint):
    """Per prompt: float32's greedy tokens, and its top-two logit margin at each of them."""
    outs = LLM(checkpoint=checkpoint, dtype="float32", weights="dense").generate(PROMPT_SET, GREEDY)
    return [(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def defaults(checkpoint):
    return LLM(checkpoint=checkpoint, **served_defaults())


def divergences(float32_model, outs) -> list[tuple[int, int, float]]:
    """(prompt, position, float32's margin there) for every prompt whose tokens leave float32's."""
    found = []
    for i, ((want, margins), out) in enumerate(zip(float32_model, outs)):
        first = next((j for j, (a, b) in enumerate(zip(want, out.token_ids)) if a != b), None)
        if first is not None:
            found.append((i, first, margins[first]))
    return found


@pytest.mark.parametrize("batch", [1, 32])
def test_the_served_defaults_give_float32s_greedy_tokens_up_to_near_ties(defaults, float32_model, batch):
    assert len(PROMPT_SET) == 32
    if batch == 1:
        outs = [defaults.generate([p], GREEDY)[0] for p in PROMPT_SET]
    else:
        outs = defaults.generate(PROMPT_SET, GREEDY)  # 32 requests through the scheduler at once
    assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
    flips = divergences(float32_model, outs)
    assert all(margin < MARGIN_BOUND for _, _, margin in flips), f"divergences (prompt, position, margin): {flips}"
