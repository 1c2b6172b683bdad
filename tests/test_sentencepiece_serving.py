"""A checkpoint whose tokenizer is SentencePiece (Mistral's real tokenizer.model v1 on a tiny random Llama) served:
a completions prompt gets the BOS its config asks for, a chat prompt only the template's, and streamed text equals
the one-shot text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.tokenizer import load_tokenizer

mistral_common = pytest.importorskip("mistral_common")

TOKENIZER_MODEL = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (written directly: importing transformers costs seconds) with v1's tokenizer."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("mistral-v1-tiny")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (32000, 32),
        "lm_head.weight": (32000, 32),
        "model.norm.weight": (32,),
        "model.layers.0.input_layernorm.weight": (32,),
        "model.layers.0.post_attention_layernorm.weight": (32,),
        "model.layers.0.self_attn.q_proj.weight": (32, 32),
        "model.layers.0.self_attn.k_proj.weight": (16, 32),
        "model.layers.0.self_attn.v_proj.weight": (16, 32),
        "model.layers.0.self_attn.o_proj.weight": (32, 32),
        "model.layers.0.mlp.gate_proj.weight": (64, 32),
        "model.layers.0.mlp.up_proj.weight": (64, 32),
        "model.layers.0.mlp.down_proj.weight": (32, 64),
    }
    save_file({k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}, str(path / "model.safetensors"))
    (path / "tokenizer.model").symlink_to(TOKENIZER_MODEL)
    (path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return path


@pytest.fixture(scope="module")
def served(checkpoint, server_factory):
    import openai

    with server_factory("--model", str(checkpoint)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_completions_and_chat_prompts_get_one_bos(served, checkpoint):
    tok = load_tokenizer(checkpoint)
    model = served.models.list().data[0].id
    prompt = "Once upon a time"
    out = served.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert out.usage.prompt_tokens == len(tok.encode(prompt)) + 1  # <s> first
    assert out.choices[0].text.startswith(prompt)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = served.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))  # the template's <s> only
    assert tok.encode(tok.apply_chat_template(messages))[:2] != [1, 1]


def test_streamed_text_equals_the_one_shot_text(served):
    model = served.models.list().data[0].id
    kwargs = {"model": model, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    whole = served.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in served.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole and whole


def test_echo_offsets_index_the_returned_text(served, checkpoint):
    """lm-eval's echo with logprobs (issue 60): each token's text_offset is where its text starts in the returned
    text, the prompt's and the generated tokens' alike; the "▁" SentencePiece put before the prompt is not there."""
    tok = load_tokenizer(checkpoint)
    model = served.models.list().data[0].id
    prompt = "Hello world, once upon a time"
    for sent in (prompt, tok.encode(prompt)):
        out = served.completions.create(
            model=model,
            prompt=sent,
            max_tokens=6,
            temperature=0,
            echo=True,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        c = out.choices[0]
        tokens, offsets = c.logprobs.tokens, c.logprobs.text_offset
        assert len(tokens) == out.usage.prompt_tokens + out.usage.completion_tokens == len(offsets)
        first = 1 if isinstance(sent, str) else 0  # the BOS the tokenizer added: not in the echo, at offset 0
        assert offsets[: first + 2] == [0] * first + [0, 5]
        assert tokens[: first + 2] == ["<s>"] * first + ["Hello", " world"]
        ends = [*offsets[1:], len(c.text)]
        for k in range(first, len(tokens)):
            if not tokens[k].startswith("bytes:"):
                assert c.text[offsets[k] : ends[k]] == tokens[k], (k, tokens, offsets, c.text)
