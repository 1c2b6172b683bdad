"""gateway.api.detokenizer: streamed text equals the one-shot decode, never splits a character, and honours stops."""

from __future__ import annotations

import random

import pytest

from engine.model.model_files import ModelNotFoundError, default_model_path
from engine.model.tokenizer import Tokenizer, load_tokenizer
from gateway.api.detokenizer import IncrementalDetokenizer, token_text

TEXTS = [
    "Hello, world!",
    "😀",
    "I ❤️ NY 🎉🎉",
    "👨‍👩‍👧‍👦 family",
    "🏳️‍🌈 and 🇯🇵🇫🇷 flags",
    "🤷🏻‍♀️👍🏽",
    "日本語のテキスト",
    "中文字符测试, mixed with ASCII 123",
    "한국어 텍스트입니다 안녕하세요",
    "naïve café résumé Straße",
    "Ελληνικά и кириллица",
    "def f(x):\n    return x * 2  # 🐍\n",
    "𝟙𝟚 ½ ①②③ \U0001f9d1\u200d\U0001f4bb",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    try:
        return load_tokenizer(default_model_path())
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def groups(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """`ids` one by one, or in random-size groups (some empty)."""
    if rng is None:
        return [[i] for i in ids]
    out, pos = [], 0
    while pos < len(ids):
        n = rng.randint(0, 4)
        out.append(ids[pos : pos + n])
        pos += n
    return out


def stream(tok, ids, stop=(), rng=None, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=skip_special_tokens)
    pieces = [d.push(g) for g in groups(ids, rng)]
    pieces.append(d.flush())
    assert "".join(pieces) == d.text
    return d, pieces


# --- plain streaming ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_stream_equals_decode_without_broken_chars(tok, text, seed):
    ids = tok.encode(text)
    d, pieces = stream(tok, ids, rng=None if seed is None else random.Random(seed))
    assert not any("\ufffd" in p for p in pieces)
    assert d.text == text == tok.decode(ids)
    assert d.num_tokens == len(ids) and not d.stopped


def test_multibyte_is_split_across_tokens(tok):
    # The test strings above really exercise the hold-back: an emoji's bytes span several tokens.
    ids = tok.encode("😀👍🏽")
    assert any(
        tok.token_bytes(i).decode("utf-8", "replace") != tok.token_bytes(i).decode("utf-8", "ignore") for i in ids
    )
    d = IncrementalDetokenizer(tok)
    first = d.push(ids[:1])
    assert first == ""  # an incomplete emoji is held back


def _byte_tokens(tok, pred):
    return [
        i for i in range(tok.vocab_size) if i not in tok.special_token_ids and (b := tok.token_bytes(i)) and pred(b)
    ]


def test_invalid_utf8_matches_whole_decode(tok):
    cont = _byte_tokens(tok, lambda b: all(0x80 <= x < 0xC0 for x in b))
    lead = _byte_tokens(tok, lambda b: len(b) == 1 and 0xE0 <= b[0] < 0xF5)
    assert cont and lead
    hello = tok.encode("Hello")
    emoji = tok.encode("😀")
    cases = [
        [cont[0]],  # lone continuation byte
        hello + [cont[0], cont[1]] + hello,
        [lead[0]] + hello,  # lead byte cut short by ASCII
        [lead[0], lead[0]] + emoji,  # two truncated leads, then a valid emoji
        emoji[:-1] + emoji,  # an emoji missing its last byte, then a whole one
        hello + emoji[:-1],  # truncated at the very end: flush gives U+FFFD
        emoji[:1],
    ]
    for ids in cases:
        expected = tok.decode(ids, skip_special_tokens=True)
        assert "\ufffd" in expected
        for seed in (None, 3):
            d, _pieces = stream(tok, ids, rng=None if seed is None else random.Random(seed))
            assert d.text == expected, ids


def test_random_token_sequences_match_whole_decode(tok):
    rng = random.Random(1234)
    byte_ids = _byte_tokens(tok, lambda b: any(x >= 0x80 for x in b))
    pool = byte_ids + [i for t in TEXTS for i in tok.encode(t)]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        d, _ = stream(tok, ids, rng=rng)
        assert d.text == tok.decode(ids, skip_special_tokens=True), ids


def test_special_tokens_and_out_of_vocab_ids(tok):
    ids = tok.encode("<|im_start|>assistant\nhi 😀<|im_end|>")
    specials = [i for i in ids if i in tok.special_token_ids]
    assert len(specials) == 2
    ids = ids + [tok.vocab_size, tok.vocab_size + 7] + tok.encode("!") + [tok.eos_token_id]
    d, _ = stream(tok, ids)
    assert d.text == "assistant\nhi 😀!" == tok.decode(ids, skip_special_tokens=True)
    assert d.num_tokens == len(ids)
    d, _ = stream(tok, ids, skip_special_tokens=False)
    assert d.text == tok.decode(ids) and d.text.startswith("<|im_start|>")


def test_token_offsets(tok):
    text = "The end of the story."
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    d.push(ids)
    d.flush()
    starts, pos = [], 0
    for i in ids:
        starts.append(pos)
        pos += len(tok.token_bytes(i).decode())
    assert d.token_offsets == starts
    ids = tok.encode("a😀b")
    d, _ = stream(tok, ids)
    assert len(d.token_offsets) == d.num_tokens == len(ids)
    assert d.token_offsets == sorted(d.token_offsets)
    assert d.token_offsets[0] == 0 and d.token_offsets[-1] == 2  # "b" starts after "a😀"


# --- stop strings ------------------------------------------------------------------------------------------------


def stop_case(tok, text, stop, rng=None):
    ids = tok.encode(text)
    d, pieces = stream(tok, ids, stop=stop, rng=rng)
    return d, pieces, ids


def test_stop_single_token(tok):
    d, _pieces, _ids = stop_case(tok, "The end of the story.", [" of"])
    assert d.text == "The end" and d.stopped
    assert d.num_tokens == 3  # the token that completed the stop is the last one taken
    assert d.push(tok.encode(" more")) == "" and d.flush() == ""
    assert d.text == "The end"


@pytest.mark.parametrize("seed", [None, 5])
def test_stop_spanning_tokens(tok, seed):
    text = "Hello world, STOP here and more"
    stop = ["world, STOP"]
    assert len(tok.encode(stop[0])) >= 3
    d, pieces, _ = stop_case(tok, text, stop, rng=None if seed is None else random.Random(seed))
    assert d.text == "Hello " and d.stopped
    assert not any("world" in p or "here" in p for p in pieces)


def test_stop_at_start(tok):
    d, pieces, _ = stop_case(tok, "Hello world", ["Hello"])
    assert d.text == "" and d.stopped and all(p == "" for p in pieces)


def test_earliest_occurrence_wins(tok):
    # Both stops complete with the same token push: the one earlier in the text wins, not the one listed first.
    d = IncrementalDetokenizer(tok, stop=["brown", "quick"])
    out = d.push(tok.encode("The quick brown fox")) + d.flush()
    assert out == d.text == "The " and d.stopped
    # Streamed token by token, too.
    d, _, _ = stop_case(tok, "The quick brown fox", ["fox", "brown", "quick"])
    assert d.text == "The "


def test_stop_never_occurs(tok):
    text = "Hello world, ST OP here 😀"
    d, _pieces, ids = stop_case(tok, text, ["STOP", "😀!"])
    assert d.text == text == tok.decode(ids) and not d.stopped


def test_partial_match_then_diverges(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out = [d.push(tok.encode("Hello world, ")), d.push(tok.encode("ST"))]
    assert "ST" not in "".join(out)  # could still become "STOP": held back
    out.append(d.push(tok.encode("OX and more")))
    out.append(d.flush())
    assert "".join(out) == d.text == "Hello world, STOX and more" and not d.stopped
    # Held back only as long as a prefix of a stop string remains.
    d = IncrementalDetokenizer(tok, stop=["abcdef"])
    assert d.push(tok.encode("xyz a")) == "xyz "
    assert d.push(tok.encode("b")) == ""
    assert d.push(tok.encode("q")) == "abq"


def test_stop_with_emoji(tok):
    text = "Good job 👍🏽 really 🎉 yes"
    for stop in (["👍🏽"], ["🏽 really"], ["🎉 y"]):
        for seed in (None, 9):
            d, pieces, _ = stop_case(tok, text, stop, rng=None if seed is None else random.Random(seed))
            assert d.stopped and d.text == text[: text.index(stop[0])]
            assert not any("\ufffd" in p for p in pieces)


def test_stop_fuzz_against_reference(tok):
    rng = random.Random(77)
    text = "the cat sat on the mat 😀 and the 日本 dog sat too; 🇯🇵 then the end"
    ids = tok.encode(text)
    # Decoded text after each token: the byte prefix, an incomplete last character dropped.
    prefix_len = [len(tok.decode_bytes(ids[: k + 1]).decode("utf-8", "ignore")) for k in range(len(ids))]
    for _ in range(150):
        a = rng.randrange(len(text))
        stops = [text[a : a + rng.randint(1, 6)] for _ in range(rng.randint(1, 3))]
        stops += rng.sample(["zz", "cat!", "日本語", "😀😀"], 1)
        # Reference: the first token that completes an occurrence; the cut is the earliest among those completed.
        occ = [(i, i + len(s)) for s in set(stops) for i in range(len(text)) if text.startswith(s, i)]
        first_end = min(e for _, e in occ)
        done = next(k for k, n in enumerate(prefix_len) if n >= first_end)
        cut = min(i for i, e in occ if e <= prefix_len[done])
        d, _pieces = stream(tok, ids, stop=stops, rng=rng)
        assert d.stopped and d.text == text[:cut], stops
        assert d.num_tokens == done + 1


def test_min_tokens_lets_no_stop_string_end_the_text_before_them(tok):
    """As vLLM's: a stop string must end in the text of a token past min_tokens (" of" is the third token here)."""
    text = "The end of the story. The end of it all."
    ids = tok.encode(text)
    assert [tok.decode([i]) for i in ids[:3]] == ["The", " end", " of"]
    for min_tokens, kept in ((2, "The end"), (3, "The end of the story. The end")):
        for seed in (None, 4):
            d = IncrementalDetokenizer(tok, stop=[" of"], min_tokens=min_tokens)
            out = "".join(d.push(g) for g in groups(ids, None if seed is None else random.Random(seed))) + d.flush()
            assert out == d.text == kept and d.stopped


def test_the_stop_token_that_ended_a_sequence_is_counted_but_not_shown(tok):
    """The engine's eos or stop token id (here ".", not a special token) ends the text before it, as vLLM's."""
    ids = tok.encode("The end.")
    assert ids[-1] not in tok.special_token_ids
    d = IncrementalDetokenizer(tok)
    out = d.push(ids[:1]) + d.push(ids[1:], ends_with_stop_token=True) + d.flush()
    assert out == d.text == "The end"
    assert d.num_tokens == len(ids) and d.token_offsets == [0, 3, 7]
    # A stop string its text would complete does not fire either.
    d = IncrementalDetokenizer(tok, stop=["d."])
    assert d.push(ids, ends_with_stop_token=True) + d.flush() == "The end" and not d.stopped


# --- token_text --------------------------------------------------------------------------------------------------


def test_token_text(tok):
    (hello,) = tok.encode("Hello")
    assert token_text(tok, hello) == "Hello"
    assert token_text(tok, tok.eos_token_id) == tok.eos_token and tok.eos_token.startswith("<|")
    partial = tok.encode("😀")[0]
    data = tok.token_bytes(partial)
    assert token_text(tok, partial) == "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    assert token_text(tok, partial).startswith("bytes:\\xf0")
    assert token_text(tok, tok.vocab_size + 1) == ""


def test_no_tokenizer_gives_no_text_but_counts_every_token():
    """A dummy model served where the default tokenizer is absent (an offline GPU machine): token-id prompts
    still complete; the text is empty and the offsets still cover every token (found on the first GPU run: 500)."""
    detok = IncrementalDetokenizer(None, stop=["x"])
    assert detok.push([5, 6, 7]) == ""
    assert detok.push([8]) == ""
    assert detok.flush() == ""
    assert detok.text == "" and detok.token_offsets == [0, 0, 0, 0] and not detok.stopped


def test_echoed_prompt_offsets_slice_the_echo(tok):
    """Byte-level (SmolLM2): each echoed prompt token's text is the echo's slice at its offset (issue 60 checks
    SentencePiece's in test_sentencepiece_tokenizer.py)."""
    from tokenizer_texts import assert_echo_slices, varied_texts

    for t in varied_texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], 600, seed=60):
        ids = tok.encode(t, add_special_tokens=True)
        if not ids or tok.decode(ids) != t:
            continue  # bytes the vocabulary has no token for are dropped: not in the ids, so in no token's text
        assert_echo_slices(tok, t, ids, t)
        assert_echo_slices(tok, ids, ids, tok.decode(ids))
