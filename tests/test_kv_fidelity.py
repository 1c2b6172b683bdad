"""tests/test_fidelity.py's budget for `--kv-cache-dtype auto` on a tiny random checkpoint of each family the registry
knows (and the Llama variants with their own twists: Qwen2's biases and tied head, Mistral's window): the served
default cache gives the float32 cache's greedy tokens up to near-ties, 32 prompts x 32 tokens in a batch of 32 and
the first ALONE of them alone (bench/offline/kv_cache_fidelity.py runs all 32 alone: a prompt flipped alone exactly
where it flipped in the batch). The bundled model's budget is tests/test_fidelity.py's, which runs the served defaults."""

import pytest
import torch
from test_families import CASES, build
from test_fidelity import GREEDY, MARGIN_BOUND, NUM_TOKENS, divergences

from engine import LLM
from engine.runner.kv_dtype import CPU_AUTO_KV_DTYPE

# One checkpoint per family of engine/model/families/, and the Llama variants whose layers differ.
ALONE = 8  # prompts run one at a time too: each costs a 32-step run of its own
FAMILY_CASES = ["llama 2", "qwen2 tied", "mistral (sliding window)", "phi3 (sliding window)", "gemma2", "gemma3 (text)"]


def random_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 120, (32,), generator=gen)
    return [torch.randint(1, 300, (int(n),), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_auto_kv_cache_gives_the_float32_caches_greedy_tokens_up_to_near_ties(case, tmp_path):
    kind, extra = CASES[case]
    build(kind, tmp_path, **extra)
    prompts = random_prompts()
    reference = LLM(str(tmp_path), dtype="float32", max_num_seqs=32, kv_cache_dtype="float32").generate(prompts, GREEDY)
    want = [(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs]) for o in reference]
    served = LLM(str(tmp_path), dtype="float32", max_num_seqs=32)  # --kv-cache-dtype auto, as served
    assert served.engine.executor.runner.kv_caches[0].dtype == getattr(torch, CPU_AUTO_KV_DTYPE)
    batch = served.generate(prompts, GREEDY)
    alone = [served.generate([p], GREEDY)[0] for p in prompts[:ALONE]]
    assert all(len(o.token_ids) == NUM_TOKENS for o in batch + alone)
    for outs in (alone, batch):
        flips = divergences(want, outs)
        assert all(margin < MARGIN_BOUND for _, _, margin in flips), f"divergences (prompt, position, margin): {flips}"
