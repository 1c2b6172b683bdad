"""The engine against transformers on the same GGUF: logits, greedy tokens, scheduling, preemption."""

import pytest
import torch
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.launch import build_engine

NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # The module serves the same prompts test after test: drafted from the earlier answers, the staggered test's
    # first requests would finish before the last arrives (tests/test_speculative.py covers those drafts).
    return LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", speculative_shared=False)


@pytest.fixture(scope="module")
def reference_tokens(hf_model, tokenizer):
    """transformers' greedy continuation of every prompt: one left-padded batch through `generate` (the same tokens as
    one prompt at a time with its own KV cache, checked when this was written: 6 s instead of 36)."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, ids))
    padded = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
        out = hf_model.generate(
            padded,
            attention_mask=mask,
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, width:].tolist()


def first_logits(engine: EngineCore, prompt_ids: list[list[int]]) -> torch.Tensor:
    for ids in prompt_ids:
        engine.add_request(ids, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    logits = engine.runner.run(batch)
    for r in batch.requests:
        engine.abort_request(r.request_id)
    return logits


def test_first_iteration_logits_match_transformers(checkpoint, hf_model, tokenizer):
    # float32 inputs to the block matmuls: the reference's products, so only the order of sums differs
    engine = build_engine(
        EngineConfig(dtype="float32", kv_cache_dtype="float32", block_activations="float32"), checkpoint
    )
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS[:6]]
    ours = first_logits(engine, prompt_ids)  # all six in one flattened batch
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    for i, ids in enumerate(prompt_ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        rel = ((ours[i] - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, f"prompt {i}: relative error {rel:.2e}"


def test_greedy_one_at_a_time_matches_transformers(llm, reference_tokens):
    for prompt, ref in zip(PROMPTS, reference_tokens):
        [c] = llm.generate([prompt], GREEDY)
        assert c.token_ids == ref, f"{prompt!r}"
        assert c.finish_reason == "length"


def test_greedy_batched_with_staggered_arrivals_matches_transformers(llm, tokenizer, reference_tokens):
    engine = llm.engine
    pending = list(enumerate(PROMPTS))
    requests, batch_sizes = {}, []
    while pending or engine.has_unfinished():
        if pending:  # a new request arrives every iteration, joining those already decoding
            i, prompt = pending.pop(0)
            requests[i] = engine.add_request(tokenizer.encode(prompt), GREEDY)
        engine.step()
        batch_sizes.append(engine.last_batch_size)
    assert max(batch_sizes) == len(PROMPTS)
    for i, ref in enumerate(reference_tokens):
        assert requests[i].output_token_ids == ref, f"{PROMPTS[i]!r}"
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_all_prompts_in_one_generate_call(llm, reference_tokens):
    completions = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens


def test_preemption_and_recompute_give_the_same_tokens(checkpoint, reference_tokens):
    # 12 blocks of 16 slots cannot hold twelve requests of ~45 tokens: the newest get preempted.
    llm = LLM(
        checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", block_size=16, kv_cache_memory=12 * 737_280
    )
    engine = llm.engine
    assert engine.scheduler.kv.num_blocks == 12
    completions = llm.generate(PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in completions] == reference_tokens
    assert engine.scheduler.kv.num_free_blocks == 12


def test_chunked_prefill_matches(checkpoint, reference_tokens):
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", max_num_batched_tokens=7)
    completions = llm.generate(PROMPTS[:4], GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens[:4]


def test_request_level_mode_gives_the_same_tokens(checkpoint, reference_tokens):
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", scheduling="request", max_num_seqs=4)
    completions = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens


def test_hf_checkpoint_directory_loads_the_same_model(
    hf_model, hf_tokenizer, tokenizer, reference_tokens, tmp_path_factory
):
    from safetensors.torch import save_file

    # transformers will not save_pretrained a GGUF-loaded model; write the same files by hand.
    out = tmp_path_factory.mktemp("hf_ckpt")
    hf_model.config.to_json_file(out / "config.json")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out / "model.safetensors")
    hf_tokenizer.save_pretrained(out)
    llm = LLM(str(out), dtype="float32", kv_cache_dtype="float32")
    assert llm.tokenizer.encode(PROMPTS[1]) == tokenizer.encode(PROMPTS[1])
    assert llm.tokenizer.eos_token_id == tokenizer.eos_token_id
    completions = llm.generate(PROMPTS[:3], GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens[:3]


def test_dummy_weights_of_a_named_shape(checkpoint):
    llm = LLM("dummy:smollm2-135m", kv_cache_memory=8 * 737_280)
    [c] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(c.token_ids) == 4 and llm.engine.model_name == "dummy:smollm2-135m"


def test_the_gguf_reader_reads_what_ggufs_own_does():
    import gguf
    import numpy as np

    from engine.model.model_files import GGUFReader, default_model_path

    ours, theirs = GGUFReader(default_model_path()), gguf.GGUFReader(default_model_path())
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():  # strings, string arrays (tokens, merges), int arrays (token types)
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert mine.contents() == field.contents(), key
        assert [bytes(p) for p in mine.parts] == [bytes(p) for p in field.parts], key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors
    ]
    for a, b in zip(ours.tensors[:4], theirs.tensors[:4]):
        assert type(a.data) is np.ndarray and np.array_equal(a.data, b.data)
