"""Byte-level BPE tokenizer.json files of the Llama 3, Qwen2 and GPT-2 styles: tokenizers trained here with
`tokenizers` (no download) and loaded by Orcinus (tiktoken) encode a few hundred strings exactly alike."""

import json
import random

import pytest

from engine.model.tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN, hf_pretokenizer_pattern, load_tokenizer

SAMPLES = [
    "Hello, world! I'm here; you're there. DON'T shout, we'll see.",
    "Prices: 3.14159, 1234567 and 12 345 -- 2024-11-23 at 07:45.",
    "naïve café, Straße, ÆØÅ, 日本語のテキスト, 한국어, العربية, emoji 🙂🚀 and ✓.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\r\n",
    "   leading spaces, trailing spaces   \n\n  \t mixed\t\twhitespace  ",
    "URLs like https://example.com/a?b=c&d=e#f, emails a.b@c.de, paths /usr/local/bin.",
    "Numbers glued: abc123def, 4x4, v2.0.1, 1st 2nd 3rd, ½ ⅓ ², ١٢٣ ٤٥٦.",
]


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = list(SAMPLES)
    for _ in range(n):
        a, b = rng.sample(SAMPLES, 2)
        cut_a, cut_b = rng.randrange(len(a)), rng.randrange(len(b))
        out.append(a[:cut_a] + rng.choice(["", " ", "\n", "  ", "'s ", "123"]) + b[cut_b:])
    return out


def train(style: str, tmp_path):
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern = LLAMA3_PATTERN if style == "llama3" else QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus(300, 0), trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return tok


@pytest.mark.parametrize("style", ["llama3", "qwen2", "gpt2"])
def test_a_trained_tokenizer_encodes_like_tokenizers(style, tmp_path):
    hf = train(style, tmp_path)
    ours = load_tokenizer(tmp_path)
    texts = corpus(300, 1) + [s.upper() for s in SAMPLES] + ["", " ", "\n", "<|end|> after a special <|end|>"]
    mismatches = [t for t in texts if ours.encode(t) != hf.encode(t).ids]
    assert not mismatches, mismatches[:3]
    assert ours.eos_token_id == hf.token_to_id("<|end|>")
    for t in texts[:50]:
        assert ours.decode(ours.encode(t)) == t


def test_an_unsupported_pre_tokenizer_is_named():
    with pytest.raises(ValueError, match="unsupported pre-tokenizer \\['Metaspace'\\]"):
        hf_pretokenizer_pattern({"type": "Metaspace", "replacement": "▁"})


def test_bos_as_the_post_processor_or_the_config_asks(tmp_path):
    from tokenizers import processors

    hf = train("llama3", tmp_path)
    hf.add_special_tokens(["<|begin|>"])
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", hf.token_to_id("<|begin|>"))]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin|>", "eos_token": "<|end|>"}))
    ours = load_tokenizer(tmp_path)
    assert ours.add_bos_token and ours.bos_token == "<|begin|>"
    for t in corpus(50, 2):
        assert ours.encode(t, add_special_tokens=True) == hf.encode(t).ids  # Llama 3's <|begin_of_text|> first
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin|>", "add_bos_token": False}))
    assert load_tokenizer(tmp_path).encode("hi", add_special_tokens=True) == ours.encode("hi")


def test_gguf_pre_tokenizers():
    from engine.model.tokenizer.byte_level import TEKKEN_PATTERN, gguf_pretokenizer_pattern

    assert gguf_pretokenizer_pattern("tekken") == TEKKEN_PATTERN and gguf_pretokenizer_pattern("smollm") is None
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'deepseek-llm': supported are gpt-2, "):
        gguf_pretokenizer_pattern("deepseek-llm")
