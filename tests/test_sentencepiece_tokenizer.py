"""SentencePiece-style BPE against `sentencepiece` on Mistral's real tokenizer.model files (v1: Llama 2's layout,
32000 pieces; v3 and v7: 32768 with control and user-defined tokens), each loaded from the tokenizer.model, from a
GGUF written from it and from a tokenizer.json: encode, decode and streamed text equal the reference's."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tokenizer_texts import assert_echo_slices, varied_texts
from tokenizers import Tokenizer as Backend

from engine.model.tokenizer import SentencePieceBPE, load_tokenizer
from engine.model.tokenizer.sentencepiece_model import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    SentencePieceVocab,
    read_sentencepiece_model,
)
from gateway.api.completions import _echoed_tokens
from gateway.api.detokenizer import IncrementalDetokenizer

sentencepiece = pytest.importorskip("sentencepiece")
mistral_common = pytest.importorskip("mistral_common")

DATA = Path(mistral_common.__file__).parent / "data"
V1, V3, V7 = (
    "tokenizer.model.v1",
    "mistral_instruct_tokenizer_240323.model.v3",
    "mistral_instruct_tokenizer_241114.model.v7",
)
# (file, where it is loaded from); v7 differs from v3 only in a few control and user-defined tokens, and a
# tokenizer.json is read by `tokenizers` whatever its vocabulary.
CASES = [
    (V1, "tokenizer.model"),
    (V1, "gguf"),
    (V1, "tokenizer.json"),
    (V3, "tokenizer.model"),
    (V3, "gguf"),
    (V7, "tokenizer.model"),
]


class Reference:
    """`sentencepiece` on each stretch of text between added tokens' texts, which become their ids."""

    def __init__(self, path: Path) -> None:
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        vocab = read_sentencepiece_model(path)
        self.added = {
            p: i
            for i, (p, kind) in enumerate(zip(vocab.pieces, vocab.types))
            if kind in (CONTROL, UNKNOWN, USER_DEFINED)
        }
        self.unk = self.sp.unk_id()
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")

    def encode(self, text: str) -> list[int]:
        ids = []
        for n, part in enumerate(self._split.split(text)):
            ids += [self.added[part]] if n % 2 else self.sp.encode(part)
        return ids

    def decode(self, ids: list[int]) -> str:
        # sentencepiece writes <unk> as " ⁇ "; skip_special_tokens drops it as it drops <s>.
        return self.sp.decode([i for i in ids if i != self.unk])

    def continuation(self, ids: list[int]) -> str:
        """The text `ids` add after a word: SentencePiece drops a leading space only at the start of a text."""
        anchor = self.sp.piece_to_id("a")
        return self.decode([anchor, *ids])[1:]


_REFERENCES: dict[str, Reference] = {}


def reference(name: str) -> Reference:
    if name not in _REFERENCES:
        _REFERENCES[name] = Reference(DATA / name)
    return _REFERENCES[name]


def write_gguf(path: Path, vocab: SentencePieceVocab, add_bos: bool = True) -> None:
    """A vocabulary-only GGUF, as llama.cpp's converter writes one."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.pieces)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenizer_json(tok: SentencePieceBPE) -> dict:
    """A Llama 2-layout tokenizer.json of the same vocabulary: its post-processor puts <s> first."""
    spec = json.loads(tok._backend.to_str())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    return spec


@pytest.fixture(scope="module", params=CASES, ids=[f"{m.rsplit('.', 1)[-1]}-{src}" for m, src in CASES])
def loaded(request, tmp_path_factory):
    """(ours, the reference, the reference decode of any ids): a tokenizer.json decodes as `tokenizers` does."""
    name, source = request.param
    path, ref = DATA / name, reference(name)
    where = tmp_path_factory.mktemp(source.replace(".", "_"))
    if source == "tokenizer.model":
        (where / "tokenizer.model").symlink_to(path)
        return load_tokenizer(where), ref, ref.decode
    if source == "gguf":
        write_gguf(where / "vocab.gguf", read_sentencepiece_model(path))
        return load_tokenizer(where / "vocab.gguf"), ref, ref.decode
    (where / "tokenizer.json").write_text(json.dumps(tokenizer_json(_load(path))))
    (where / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    backend = Backend.from_file(str(where / "tokenizer.json"))
    return load_tokenizer(where), ref, lambda ids: backend.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def texts(loaded):
    _, ref, _ = loaded
    return varied_texts(sorted(ref.added), 3000, seed=28)


@pytest.mark.parametrize("name", [V1, V3, V7])
def test_the_reader_matches_sentencepiece(name):
    path, ref = DATA / name, reference(name)
    vocab = read_sentencepiece_model(path)
    sp = ref.sp
    assert vocab.pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert vocab.scores == [sp.get_score(i) for i in range(sp.get_piece_size())]
    kinds = [
        CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else BYTE if sp.is_byte(i) else None
        for i in range(sp.get_piece_size())
    ]
    assert [
        k if k is not None else NORMAL if t == NORMAL else USER_DEFINED for k, t in zip(kinds, vocab.types)
    ] == vocab.types
    # A user-defined piece is matched whole, even inside a word.
    for piece in [p for p, t in zip(vocab.pieces, vocab.types) if t == USER_DEFINED]:
        assert sp.piece_to_id(piece) in sp.encode(f"x{piece}x")
    assert (vocab.bos_id, vocab.eos_id, vocab.add_dummy_prefix) == (sp.bos_id(), sp.eos_id(), True)


def test_metadata(loaded):
    tok, ref, _ = loaded
    assert tok.vocab_size == ref.sp.get_piece_size()
    assert (tok.bos_token_id, tok.eos_token_id, tok.bos_token, tok.eos_token) == (1, 2, "<s>", "</s>")
    assert tok.special_token_ids == {i for i in range(tok.vocab_size) if ref.sp.is_control(i) or ref.sp.is_unknown(i)}
    assert tok.add_bos_token
    assert tok.token_bytes(ref.sp.piece_to_id("<0x0A>")) == b"\n"
    assert tok.token_bytes(ref.sp.piece_to_id("▁the")) == b" the"


def test_encode_matches_sentencepiece(loaded, texts):
    tok, ref, _ = loaded
    mismatches = [t for t in texts if tok.encode(t) != ref.encode(t)]
    assert not mismatches, [(t, tok.encode(t), ref.encode(t)) for t in mismatches[:3]]


def test_decode_matches_sentencepiece(loaded, texts):
    tok, ref, reference_decode = loaded
    for t in texts:
        ids = ref.encode(t)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids), t
    rng = random.Random(4)
    space, first = ref.sp.piece_to_id("<0x20>"), [ref.sp.piece_to_id(p) for p in ["<s>", "▁", "▁▁", "<0xE6>"]]
    for n in range(2000):  # any ids: lone bytes of a character, control tokens first, runs of "▁", a first b" "
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        ids = [space, *ids] if n % 4 == 0 else [rng.choice(first), *ids] if n % 4 == 1 else ids
        assert tok.decode(ids, skip_special_tokens=True) == reference_decode(ids), ids


def test_streamed_text_is_the_reference_continuation(loaded, texts):
    tok, ref, _ = loaded
    for t in texts:
        ids = tok.encode(t)
        d = IncrementalDetokenizer(tok)
        streamed = "".join(d.push([i]) for i in ids) + d.flush()
        assert streamed == ref.continuation(ids), t


def test_a_texts_first_space_is_dropped_by_decode_not_by_streaming():
    tok = _load(DATA / V1)
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"  # the dummy prefix's space is gone
    d = IncrementalDetokenizer(tok)
    assert d.push(ids) + d.flush() == " Hello world"  # after a prompt, the space is the model's
    assert tok.decode(tok.encode(" Hello")) == " Hello"  # only the one space the encoder put there


def test_echoed_prompt_offsets_slice_the_echo(loaded, texts):
    """Issue 60: the "▁" SentencePiece puts before a text is in no echo, so no offset may count it."""
    tok, _, _ = loaded
    for t in texts[:1000]:
        ids = tok.encode(t, add_special_tokens=True)
        assert_echo_slices(tok, t, ids, t)  # a text prompt echoes as sent
        if ids[1:]:
            assert_echo_slices(tok, ids[1:], ids[1:], tok.decode(ids[1:]))  # token ids echo as their decoded text


def test_echoed_offsets_of_mistral_and_gemma_layouts():
    """The offsets themselves: Mistral's (a space before each text) and Gemma's (none: nothing to take away)."""
    vocab = read_sentencepiece_model(DATA / V1)
    mistral = _load(DATA / V1)
    gemma = SentencePieceBPE.from_pieces(
        vocab.pieces, vocab.scores, vocab.types, add_dummy_prefix=False, bos_token_id=1, eos_token_id=2
    )
    ids = mistral.encode("Hello world", add_special_tokens=True)
    assert _echoed_tokens(mistral, "Hello world", "Hello world", ids) == (["<s>", "Hello", " world"], [0, 0, 5])
    assert _echoed_tokens(mistral, ids[1:], "Hello world", ids[1:]) == (["Hello", " world"], [0, 5])
    ids = gemma.encode("Hello world", add_special_tokens=True)
    assert [gemma.decode([i]) for i in ids[1:]] == ["Hello", " world"]
    assert _echoed_tokens(gemma, "Hello world", "Hello world", ids) == (["<s>", "Hello", " world"], [0, 0, 5])
    for t in varied_texts(["<s>", "</s>"], 300, seed=60):
        assert_echo_slices(gemma, t, gemma.encode(t, add_special_tokens=True), t)


def test_bos_for_completions_prompts(tmp_path):
    tok = _load(DATA / V1)
    hello = tok.encode("Hello")
    assert tok.encode("Hello", add_special_tokens=True) == [1, *hello]
    assert tok.encode("<s>Hello", add_special_tokens=True) == [1, *hello]  # a template's BOS is not doubled
    assert tok.encode("", add_special_tokens=True) == [1]
    (tmp_path / "tokenizer.model").symlink_to(DATA / V1)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert load_tokenizer(tmp_path).encode("Hello", add_special_tokens=True) == hello
    # A GGUF says it in tokenizer.ggml.add_bos_token (llama.cpp's default for SentencePiece is to add it).
    full = read_sentencepiece_model(DATA / V1)
    small = SentencePieceVocab(full.pieces[:300], full.scores[:300], full.types[:300])
    for add_bos in (True, False):
        write_gguf(tmp_path / f"{add_bos}.gguf", small, add_bos=add_bos)
        tok = load_tokenizer(tmp_path / f"{add_bos}.gguf")
        assert tok.encode("ab", add_special_tokens=True) == [1] * add_bos + tok.encode("ab")


def test_chat_template_from_the_directory(tmp_path):
    (tmp_path / "tokenizer.model").symlink_to(DATA / V3)
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }}[/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "default", "template": template},
                    {"name": "tool_use", "template": "{{ tools }}"},
                ]
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<s>[INST] Hi[/INST]"
    assert tok.encode(prompt)[:2] == [1, 3] and tok.encode(prompt)[-1] == 4
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert load_tokenizer(tmp_path).apply_chat_template([]) == "</s>"


def test_unsupported_models_are_named(tmp_path):
    unigram = bytes([0x12, 0x02, 0x18, 0x01])  # trainer_spec { model_type: UNIGRAM }
    (tmp_path / "tokenizer.model").write_bytes(unigram)
    with pytest.raises(ValueError, match="only SentencePiece BPE"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("kind", ["LlamaTokenizer", "GemmaTokenizer"])
def test_a_tokenizer_json_transformers_writes(kind, tmp_path):
    """transformers' own SentencePiece layouts (Llama: a Metaspace pre-tokenizer and Strip; Gemma: no prefix space,
    a split at spaces, no Strip) over v1's vocabulary, saved and read back by transformers and by us."""
    transformers = pytest.importorskip("transformers")
    from transformers.tokenization_utils_base import generate_merges

    vocab = read_sentencepiece_model(DATA / V1)
    ids = {p: i for i, p in enumerate(vocab.pieces)}
    merges = generate_merges(ids, dict(zip(vocab.pieces, vocab.scores)))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if kind == "GemmaTokenizer":
        names.update(pad_token="<unk>", mask_token="</s>")
    getattr(transformers, kind)(vocab=ids, merges=merges, add_bos_token=True, **names).save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, SentencePieceBPE) and ours.vocab_size == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.special_token_ids == set(theirs.all_special_ids)
    for t in varied_texts(["<s>", "</s>", "<unk>"], 1000, seed=5):
        assert ours.encode(t) == theirs.encode(t, add_special_tokens=False), t
        with_bos = theirs.encode(t)
        doubled = with_bos[:2] == [ours.bos_token_id] * 2  # we never double a BOS the text starts with
        assert ours.encode(t, add_special_tokens=True) == with_bos[doubled:], t
        ids = ours.encode(t)
        assert ours.decode(ids) == theirs.decode(ids), t
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), t
        d = IncrementalDetokenizer(ours)
        streamed = "".join(d.push([i]) for i in ids) + d.flush()
        anchor = ours.encode("a")[-1]
        assert streamed == theirs.decode([anchor, *ids], skip_special_tokens=True)[len(theirs.decode([anchor])) :], t


def _load(model_file: Path) -> SentencePieceBPE:
    vocab = read_sentencepiece_model(model_file)
    return SentencePieceBPE.from_pieces(vocab.pieces, vocab.scores, vocab.types, bos_token_id=1, eos_token_id=2)
