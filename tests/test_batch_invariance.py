"""--batch-invariant: the same 12 requests (6 greedy, 6 seeded samples) give bit-identical tokens and logprobs alone, in
batches of 8 and in a batch of 32 beside requests that come and go, with prompts long enough to be split over steps and
prefixes shared through the cache; and its attention, one query at a time, is the reference's."""

import pytest
import torch
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.attention.backend import AttentionMetadata, AttentionParams
from engine.runner.device import DeviceError

NUM_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
REQUESTS = [(p, GREEDY) for p in PROMPTS[:6]]
REQUESTS += [
    (p, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=3))
    for i, p in enumerate(PROMPTS[6:])
]
# Other traffic: long prompts (two of them past the 512-token step budget together, so prompts get cut across steps),
# a chat prompt sharing a cached block with one of the 12, and outputs of many lengths, so the batch changes every few
# steps.
FILLERS = [
    (
        PROMPTS[i % 12] + " and then some more words" * (40 if i % 5 == 0 else 0),
        SamplingParams(max_tokens=2 + i, temperature=0.7, seed=i),
    )
    for i in range(20)
]


def outputs(completions) -> list[tuple[list[int], list]]:
    return [(c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs]) for c in completions]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, batch_invariant=True, max_num_seqs=32)


def test_requests_give_the_same_bits_alone_in_batches_of_8_and_in_a_batch_of_32(llm):
    # auto's 16-bit cache: every query reads its keys from the cache, so each is rounded once however the prompt split
    assert llm.engine.executor.runner.kv_caches[0].dtype == torch.float16
    prompts, params = [p for p, _ in REQUESTS], [s for _, s in REQUESTS]
    alone = [outputs(llm.generate([p], s))[0] for p, s in REQUESTS]
    eights = outputs(llm.generate(prompts[:8], params[:8]))
    rest = llm.generate(prompts[8:] + [p for p, _ in FILLERS[:4]], params[8:] + [s for _, s in FILLERS[:4]])
    eights += outputs(rest[:4])
    mixed = [r for pair in zip(REQUESTS, FILLERS) for r in pair] + FILLERS[12:]  # the 12 spread among 20 others
    outs = llm.generate([p for p, _ in mixed], [s for _, s in mixed])
    thirty_two = outputs(outs[0:24:2])
    assert all(len(tokens) == NUM_TOKENS for tokens, _ in alone)
    assert eights == alone
    assert thirty_two == alone


def test_its_attention_is_the_references_for_prefill_chunks_and_decodes_together():
    from engine.attention.invariant import BatchInvariantAttention
    from engine.attention.torch_backend import TorchAttention

    g = torch.Generator().manual_seed(0)
    num_kv_heads, block_size, head_dim, num_blocks = 2, 4, 16, 24
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g)
    # A whole prompt, a chunk late in a prompt, two decodes: 5 + 3 + 1 + 1 queries.
    query_lens, context_lens = [5, 3, 1, 1], [5, 11, 7, 14]
    tables = torch.randperm(num_blocks, generator=g)[:16].view(4, 4).int()
    meta = AttentionMetadata(
        torch.tensor([0, 5, 8, 9, 10], dtype=torch.int32),
        torch.tensor(context_lens).int(),
        tables,
        torch.zeros(10, dtype=torch.int64),
        query_lens,
        context_lens,
    )
    q = torch.randn(10, 4, head_dim, generator=g)
    for params in (AttentionParams.plain(head_dim), AttentionParams(0.2, sliding_window=6)):
        torch.testing.assert_close(
            BatchInvariantAttention().forward(q, cache, meta, params),
            TorchAttention().forward(q, cache, meta, params),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize(
    "config, error", [({"device": "cuda"}, "CPU only"), ({"attention_backend": "torch"}, "brings its own attention")]
)
def test_where_it_cannot_hold_it_is_a_clear_error(config, error):
    from engine import EngineConfig
    from engine.runner.device import batch_invariant_attention

    with pytest.raises(DeviceError, match=error):
        batch_invariant_attention(EngineConfig(batch_invariant=True, dtype="float32", **{"device": "cpu", **config}))
