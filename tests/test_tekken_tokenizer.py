"""Mistral's Tekken (tekken.json) against mistral-common's Tekkenizer on the real file it ships (tekken_240911.json;
tekken_240718.json holds the same vocabulary): every token's bytes, encode, decode and streamed text."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tokenizer_texts import varied_texts

from engine.model.tokenizer import ByteLevelBPE, load_tokenizer
from gateway.api.detokenizer import IncrementalDetokenizer

mistral_common = pytest.importorskip("mistral_common")
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"


@pytest.fixture(scope="module")
def ref() -> Tekkenizer:
    return Tekkenizer.from_file(TEKKEN)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ByteLevelBPE:
    where = tmp_path_factory.mktemp("tekken")
    (where / "tekken.json").symlink_to(TEKKEN)
    return load_tokenizer(where)


@pytest.fixture(scope="module")
def special(ref) -> dict[str, int]:
    return {ref.id_to_piece(i): i for i in range(ref.num_special_tokens)}


@pytest.fixture(scope="module")
def texts(special):
    named = [t for t in special if not t.startswith("<SPECIAL_")] + ["<SPECIAL_42>", "<SPECIAL_999>"]
    return varied_texts(named, 3000, seed=11)


@pytest.fixture(scope="module")
def reference_encode(ref, special):
    """mistral-common encodes special-token text as text; here it becomes the token, the rest is Tekkenizer's."""
    split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")

    def encode(text: str) -> list[int]:
        ids = []
        for n, part in enumerate(split.split(text)):
            ids += [special[part]] if n % 2 else ref.encode(part, bos=False, eos=False)
        return ids

    return encode


def test_vocabulary(tok, ref, special):
    assert tok.vocab_size == ref.n_words == 131072
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_id, ref.eos_id) == (1, 2)
    assert tok.special_token_ids == ref.special_ids == set(range(1000))
    assert all(tok.token_bytes(i) == ref.id_to_byte_piece(i, SpecialTokenPolicy.KEEP) for i in range(tok.vocab_size))
    assert special["[INST]"] == 3 and tok.add_bos_token


def test_encode_matches_mistral_common(tok, ref, reference_encode, texts):
    mismatches = [t for t in texts if tok.encode(t) != reference_encode(t)]
    assert not mismatches, mismatches[:3]
    assert tok.encode("[INST] Hi [/INST]") == [3, *ref.encode(" Hi ", bos=False, eos=False), 4]
    assert tok.encode("Hi", add_special_tokens=True) == ref.encode("Hi", bos=True, eos=False)


def test_decode_matches_mistral_common(tok, ref, texts):
    rng = random.Random(3)
    cases = [tok.encode(t) for t in texts] + [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(2000)
    ]  # broken UTF-8 too
    for ids in cases:
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, SpecialTokenPolicy.IGNORE), ids
        assert tok.decode(ids) == ref.decode(ids, SpecialTokenPolicy.KEEP), ids


def test_streamed_text_is_the_reference_decode(tok, ref, texts):
    for t in texts:
        ids = tok.encode(t)
        d = IncrementalDetokenizer(tok)
        streamed = "".join(d.push([i]) for i in ids) + d.flush()
        assert streamed == ref.decode(ids, SpecialTokenPolicy.IGNORE), t


def test_directory_config(tmp_path):
    (tmp_path / "tekken.json").symlink_to(TEKKEN)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"add_bos_token": False, "chat_template": "{{ bos_token }}[INST]{{ messages[0]['content'] }}[/INST]"}
        )
    )
    tok = load_tokenizer(tmp_path)
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<s>[INST]Hi[/INST]" and tok.encode(prompt)[:2] == [1, 3]
