"""engine.model.tokenizer against the reference: Hugging Face `tokenizers` as transformers builds it from the same GGUF."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
from tokenizer_texts import _GLUE, FRAGMENTS, _random_text

from engine.model.model_files import ModelNotFoundError, default_model_path
from engine.model.tokenizer import Tokenizer, load_tokenizer

# Bytes that no token of SmolLM2's vocabulary holds; the reference drops them.
TOKENLESS_BYTES = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])
# The ones valid text can contain: six ASCII controls, and lead bytes 0xf1/0xf2 of U+40000..U+BFFFF.
TOKENLESS_CHARS = [
    "\x04",
    "\x06",
    "\x13",
    "\x14",
    "\x16",
    "\x1d",
    "\U00040000",
    "\U0007ffff",
    "\U00080000",
    "\U000bfffd",
]


def _cases() -> list[str]:
    rng = random.Random(20240611)
    mixes = ["".join(rng.choice(FRAGMENTS) + rng.choice(_GLUE) for _ in range(rng.randint(2, 6))) for _ in range(160)]
    tokenless = [f"{a}{c}{b}" for c in TOKENLESS_CHARS for a, b in [(" ", "!"), ("x", "y"), ("", ""), ("  ", "'s")]]
    return FRAGMENTS + mixes + tokenless + [_random_text(rng) for _ in range(60)]


CASES = _cases()


@pytest.fixture(scope="module")
def model_path() -> Path:
    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def ref(model_path, hf_tokenizer):
    from tokenizers import pre_tokenizers

    reference = copy.deepcopy(hf_tokenizer)
    backend = reference.backend_tokenizer
    # transformers' GGUF loader keeps only the ByteLevel half of SmolLM2's pre-tokenizer; put the digit split back.
    assert isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel), backend.pre_tokenizer
    assert not backend.pre_tokenizer.add_prefix_space and backend.pre_tokenizer.use_regex
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    return reference


def test_case_count():
    assert len(CASES) >= 200


def test_metadata_matches_reference(tok, ref):
    assert tok.vocab_size == len(ref) == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    reference_special = frozenset(i for i, t in ref.added_tokens_decoder.items() if t.special)
    assert tok.special_token_ids == reference_special == frozenset(range(17))
    assert tok.unknown_bytes == TOKENLESS_BYTES
    assert tok.token_bytes(1) == b"<|im_start|>" and tok.token_bytes(216) == b" "


def test_reference_adds_no_special_tokens(ref):
    # add_bos_token is False in the GGUF, so comparing with add_special_tokens=False compares like with like.
    text = "<|im_start|>user\nhi<|im_end|>"
    assert ref.encode(text) == ref.encode(text, add_special_tokens=False) == [1, 4093, 198, 6004, 2]


@pytest.mark.parametrize("text", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_encode_matches_reference(tok, ref, text):
    ours, theirs = tok.encode(text), ref.encode(text, add_special_tokens=False)
    assert ours == theirs, f"text={text!r}\nours  ={ours}\ntheirs={theirs}"


def test_tokenless_bytes_are_dropped_and_neighbours_merge(tok, ref):
    # The dropped byte does not keep its neighbours apart: " \x04!" is the single token " !".
    assert tok.encode(" \x04!") == ref.encode(" \x04!", add_special_tokens=False) == tok.encode(" !")
    assert tok.encode("\x04\x06\x13\x14\x16\x1d") == []
    # Only the lead byte of U+40000 has no token; its continuation bytes are kept.
    assert tok.decode_bytes(tok.encode("\U00040000")) == "\U00040000".encode()[1:]


@pytest.mark.parametrize("text", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_decode_round_trip(tok, text):
    ids = tok.encode(text)
    kept = bytes(b for b in text.encode() if b not in TOKENLESS_BYTES)
    assert tok.decode_bytes(ids) == kept, text
    if kept == text.encode():
        assert tok.decode(ids) == text


def test_decode_of_split_character(tok):
    text = "🤷🏻‍♀️ ok"
    ids = tok.encode(text)
    first = tok.encode("🤷")
    assert len(first) > 1, "the emoji should need several byte tokens"
    assert "\ufffd" in tok.decode(first[:1])
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode()
    assert "".join(tok.decode([i]) for i in ids) != text


def test_decode_skips_special_and_out_of_vocab(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode_bytes(ids, skip_special_tokens=True) == b"user\nhi"
    assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 10_000], skip_special_tokens=True) == "user\nhi"


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Comment ça va ?\n  Two lines, 日本語, 🎉"},
    ],
    [{"role": "user", "content": "  leading spaces"}, {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=[f"conv{i}" for i in range(len(CONVERSATIONS))])
def test_chat_template_matches_transformers(tok, ref, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    if messages[0]["role"] != "system":
        assert ours.startswith("<|im_start|>system\n")


@pytest.mark.parametrize("with_tokenless", [False, True], ids=["plain", "tokenless-bytes"])
def test_encodes_a_megabyte(tok, ref, with_tokenless):
    pool = [f for f in FRAGMENTS if with_tokenless or not any(c in f for c in TOKENLESS_CHARS)]
    rng = random.Random(7)
    pieces, size = [], 0
    while size < 1 << 20:
        piece = rng.choice(pool) + rng.choice(_GLUE)
        pieces.append(piece)
        size += len(piece.encode())
    text = "".join(pieces)
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.decode_bytes(ids) == bytes(b for b in text.encode() if b not in TOKENLESS_BYTES)
