"""Model families from Hugging Face directories: tiny random checkpoints built here with transformers' own
classes (no download) load into Orcinus and give transformers' logits (float32) and greedy tokens."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint, shape_from_hf_config

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def build(kind: str, tmp_path, **extra):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():  # transformers zero-initialises biases: make Qwen2's matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    return model


CASES = {
    "llama 2": ("llama", {}),
    "llama 3.1 (scaled rope)": ("llama", {"rope_parameters": LLAMA31_ROPE}),
    "qwen2 tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2 untied": ("qwen2", {"tie_word_embeddings": False}),
    "mistral (sliding window)": ("mistral", {"sliding_window": 256}),
}
PROMPTS = [[5, 17, 200, 33, 8, 99, 120], list(range(40, 140)), [7] * 3]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tiny_checkpoint_matches_transformers(case, tmp_path):
    kind, extra = CASES[case]
    hf = build(kind, tmp_path, **extra)
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4)
    shape = llm.engine.shape
    assert shape.qkv_bias == (kind == "qwen2") and (shape.rope_scaling is not None) == ("rope_parameters" in extra)
    if kind == "mistral":
        assert llm.engine.max_model_len == 256  # the window: every attended key is inside it
    # The next-token distribution after each prompt against transformers' (top-5 logprobs, float32).
    for prompt in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1]
        [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True))
        got_top = {i: lp for i, lp in out.logprobs[0].top}
        want_lp = torch.log_softmax(want, -1)
        for i, lp in got_top.items():
            assert abs(lp - want_lp[i].item()) < 1e-4 * max(1.0, abs(lp)), (case, i)
    # 32 greedy tokens, all prompts together.
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(PROMPTS, greedy)]
    for prompt, tokens in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref, case


def test_unsupported_families_and_rope_types_say_what_is_supported():
    base = {**TINY, "model_type": "llama"}
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2': supported are llama, mistral, qwen2"):
        shape_from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'yarn'"):
        shape_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_loads_its_biases(tmp_path):
    hf = build("qwen2", tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert torch.equal(ckpt.weights["model.layers.1.self_attn.k_proj.bias"], hf.model.layers[1].self_attn.k_proj.bias)
