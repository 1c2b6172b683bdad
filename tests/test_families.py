"""Model families from Hugging Face directories: tiny random checkpoints built here with transformers' own
classes (no download) load into Orcinus and give transformers' logits (float32) and greedy tokens."""

import json
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint, shape_from_hf_config

TINY = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def build(kind: str, tmp_path, **extra):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():  # transformers zero-initialises biases: make Qwen2's matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            if kind == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(5.0)  # attention scores large enough for the soft cap to bend them
            if kind.startswith("gemma") and name.endswith("norm.weight"):  # (1 + w) norms start at w = 0: make w matter
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    return model


# Every Gemma 2 twist small enough to matter: a 16-key window on alternate layers, a scale other than 1/sqrt(head_dim),
# soft caps low enough to bend the scores and logits.
GEMMA2 = {
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 16,
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0,
    "pad_token_id": 0,
}
# Gemma 3: six layers, the last global; the windowed ones on their own RoPE base, the global one's scaled (linear).
GEMMA3 = {
    "num_hidden_layers": 6,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 16,
    "pad_token_id": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
}
PHI3_LONGROPE = {
    "original_max_position_embeddings": 64,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 8 for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)],
    },
}
CASES = {
    "llama 2": ("llama", {}),
    "llama 3.1 (scaled rope)": ("llama", {"rope_parameters": LLAMA31_ROPE}),
    "qwen2 tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2 untied": ("qwen2", {"tie_word_embeddings": False}),
    "mistral (sliding window)": ("mistral", {"sliding_window": 16}),
    "phi3 (fused qkv and gate_up tensors)": ("phi3", {"pad_token_id": 0}),
    "phi3 (sliding window)": ("phi3", {"pad_token_id": 0, "sliding_window": 16}),
    "gemma2": ("gemma2", GEMMA2),
    "gemma3 (text)": ("gemma3", GEMMA3),
}
PROMPTS = [[5, 17, 200, 33, 8, 99, 120], list(range(40, 140)), [7] * 3]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tiny_checkpoint_matches_transformers(case, tmp_path):
    kind, extra = CASES[case]
    hf = build(kind, tmp_path, **extra)
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4)
    shape = llm.engine.shape
    assert shape.qkv_bias == (kind == "qwen2") and (shape.rope_freq_factors is not None) == ("rope_parameters" in extra)
    assert type(llm.engine.model).__name__ == {
        "phi3": "Phi3Model",
        "gemma2": "Gemma2Model",
        "gemma3": "Gemma3Model",
    }.get(kind, "LlamaModel")
    if kind == "gemma3":
        assert shape.sliding_layers == (True,) * 5 + (False,) and shape.rope_local_theta == 10000.0
        assert shape.rope_freq_factors == (8.0,) * 8
    elif kind == "gemma2":  # windowed layers alternate with global ones: no request gives back its early blocks
        assert shape.sliding_layers == (True, False) and shape.kv_window is None
    elif (
        "sliding_window" in extra
    ):  # the whole context, each layer attending to the last 16 keys (the prompts are longer)
        assert llm.engine.max_model_len == 512 and shape.sliding_window == shape.kv_window == 16
    assert_matches(llm, hf, case)
    if shape.kv_window:  # a 264-token run holds about its window of KV: blocks before it go back as it goes on
        engine, kv = llm.engine, llm.engine.scheduler.kv
        engine.add_request(list(range(10, 210)), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        held = []
        while engine.has_unfinished():
            engine.step()
            held.append(kv.num_used_blocks)
        assert max(held) <= -(-16 // engine.config.block_size) + 2 < 264 // engine.config.block_size
        assert kv.num_free_blocks == kv.num_blocks


def assert_matches(llm: LLM, hf, case: str, prompts: list[list[int]] = PROMPTS) -> None:
    """The next-token distribution after each prompt (top-5 logprobs, float32) and 32 greedy tokens of each."""
    for prompt in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1]
        [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True))
        got_top = {i: lp for i, lp in out.logprobs[0].top}
        want_lp = torch.log_softmax(want, -1)
        for i, lp in got_top.items():
            assert abs(lp - want_lp[i].item()) < 1e-4 * max(1.0, abs(lp)), (case, i)
    # 32 greedy tokens, all prompts together.
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(prompts, greedy)]
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert tokens == ref, case


def test_unsupported_families_and_rope_types_say_what_is_supported():
    base = {**TINY, "model_type": "llama"}
    with pytest.raises(
        ValueError,
        match="unsupported model_type 'gpt2': supported are gemma2, gemma3_text, llama, mistral, phi3, qwen2",
    ):
        shape_from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported partial_rotary_factor"):
        shape_from_hf_config({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'dynamic'"):
        shape_from_hf_config({**base, "model_type": "phi3", "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'yarn'"):
        shape_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_loads_its_biases(tmp_path):
    hf = build("qwen2", tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert torch.equal(ckpt.weights["model.layers.1.self_attn.k_proj.bias"], hf.model.layers[1].self_attn.k_proj.bias)


# ---------------------------------------------------------------- GGUF files of the families


def write_gguf(hf, arch: str, path, freq_factors=None) -> None:
    """The checkpoint as llama.cpp's converter writes it: its tensor names, Llama's Q/K rows interleaved."""
    import gguf
    import numpy as np

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    # A byte-level vocabulary of the model's size: the 256 byte symbols, then filler pairs.
    from engine.model.tokenizer import _bytes_to_unicode

    chars = list(_bytes_to_unicode().values())
    tokens = chars + [chars[i % 256] + chars[(i * 7) % 256] for i in range(cfg.vocab_size - 256)]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_eos_token_id(0)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        # Phi-3's fused tensors, as its converter names them (gate/up under ffn_up)
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    }
    gemma = arch.startswith("gemma")
    if gemma:  # Gemma's converter: its own norm names (norms stored as 1 + w), head width, caps, window, scaling
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
            "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm",
        }
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        full = cfg.rope_parameters.get("full_attention")
        if full is not None and full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":  # its window (0 for none) and LongRoPE: the pretrained context, factors as tensors
        rope = cfg.rope_parameters
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
            )
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for key, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
                a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            name = f"blk.{i}.{names[module]}.{kind}"
            if gemma and module.endswith("norm"):
                a = a + 1
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[key]
            if gemma and key == "model.norm.weight":
                a = a + 1
        w.add_tensor(name, np.ascontiguousarray(a))
    if freq_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(freq_factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["qwen2 untied", "qwen2 tied", "llama 3.1 (scaled rope)"])
def test_a_gguf_of_the_family_matches_transformers(case, tmp_path):
    from engine.model.decoder import RopeScaling

    kind, extra = CASES[case]
    hf = build(kind, tmp_path / "hf", **extra)
    factors = None
    if "rope_parameters" in extra:  # llama.cpp keeps Llama 3.1's scaling as each frequency's divisor
        r = extra["rope_parameters"]
        factors = RopeScaling(
            r["factor"], r["low_freq_factor"], r["high_freq_factor"], r["original_max_position_embeddings"]
        ).freq_factors(16, r["rope_theta"])
    path = tmp_path / "model.gguf"
    write_gguf(hf, kind, path, factors)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    assert llm.engine.shape.qkv_bias == (kind == "qwen2")
    assert (llm.engine.shape.rope_freq_factors is not None) == (factors is not None)
    assert_matches(llm, hf, case)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_gemma_gguf_matches_transformers(kind, tmp_path):
    """Gemma as llama.cpp writes it: norms stored as 1 + w, its norm names, the window and caps as metadata, the
    layer pattern and the softmax scale (1/sqrt(head_dim) for these sizes) from the architecture."""
    extra = {**(GEMMA2 if kind == "gemma2" else GEMMA3), "query_pre_attn_scalar": 16}
    hf = build(kind, tmp_path / "hf", **extra)
    write_gguf(hf, kind, tmp_path / "model.gguf")
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", max_num_seqs=4)
    want = shape_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    got = llm.engine.shape
    for f in (
        "family",
        "head_dim",
        "sliding_window",
        "sliding_layers",
        "attn_logit_softcap",
        "final_logit_softcap",
        "rope_local_theta",
        "rope_freq_factors",
        "rope_theta",
    ):
        assert getattr(got, f) == getattr(want, f), f
    assert got.attn_scale == pytest.approx(want.attn_scale)
    assert_matches(llm, hf, f"{kind} gguf")


@pytest.mark.parametrize("extra", [{"sliding_window": 16}, PHI3_LONGROPE], ids=["window", "longrope"])
def test_a_phi3_gguf_matches_transformers(extra, tmp_path):
    """Phi-3 as llama.cpp writes it: fused attn_qkv and ffn_up (gate and up), the window as metadata, LongRoPE's
    factors as tensors."""
    hf = build("phi3", tmp_path / "hf", pad_token_id=0, **extra)
    write_gguf(hf, "phi3", tmp_path / "model.gguf")
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", max_num_seqs=4)
    want = shape_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    got = llm.engine.shape
    assert type(llm.engine.model).__name__ == "Phi3Model"
    assert (got.sliding_window, got.rope_freq_factors, got.rope_long_factors, got.rope_long_from) == (
        want.sliding_window,
        want.rope_freq_factors,
        want.rope_long_factors,
        want.rope_long_from,
    )
    assert got.rope_attention_factor == pytest.approx(want.rope_attention_factor)
    short = [[5, 17, 200, 33, 8, 99, 120], [7] * 3, list(range(60, 85))]  # inside LongRoPE's pretrained 64
    assert_matches(llm, hf, "phi3 gguf", PROMPTS if "sliding_window" in extra else short)


@pytest.mark.parametrize("kind, extra", [("phi3", {"pad_token_id": 0}), ("gemma3", GEMMA3)], ids=["phi3", "gemma3"])
def test_new_families_split_over_two_tensor_parallel_ranks_give_one_process_tokens(kind, extra, tmp_path):
    build(kind, tmp_path, **extra)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(str(tmp_path), dtype="float32").generate(PROMPTS, greedy)]
    # Phi-3's fused checkpoint tensors split by heads; Gemma 3's per-head q/k norms stay whole on every rank
    with LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, greedy)] == want


def test_phi3_longrope_is_transformers_within_and_beyond_the_pretrained_context(tmp_path):
    """Up to the pretrained context (64 here) the short divisors, from it on the long ones; cos and sin scaled."""
    hf = build("phi3", tmp_path, pad_token_id=0, **PHI3_LONGROPE)
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4)
    shape = llm.engine.shape
    assert shape.rope_long_from == 64 and shape.rope_attention_factor == pytest.approx(
        math.sqrt(1 + math.log(512 / 64) / math.log(64))
    )
    # whole sequences inside 64 positions: transformers uses the short divisors throughout, as every position here
    assert_matches(llm, hf, "phi3 longrope", [[5, 17, 200, 33, 8, 99, 120], [7] * 3, list(range(60, 85))])
    # past 64: the table's rows are transformers' cos and sin for a longer sequence (the long divisors)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, 100, 64), torch.arange(100)[None])
    table = llm.engine.model.layers[0].rotary.table
    torch.testing.assert_close(table[64:100, 0], cos[0, 64:], rtol=0, atol=1e-5)
    torch.testing.assert_close(table[64:100, 1, 8:], sin[0, 64:, 8:], rtol=0, atol=1e-5)
