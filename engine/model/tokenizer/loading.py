"""The one place that picks a checkpoint's tokenizer from what it holds, with its BOS/EOS and chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
from tokenizers import Tokenizer as Backend

from engine.model.model_files import GGUFReader
from engine.model.tokenizer.byte_level import ByteLevelBPE, gguf_pretokenizer_pattern
from engine.model.tokenizer.chat_template import pick_template, template_for
from engine.model.tokenizer.protocol import Tokenizer
from engine.model.tokenizer.sentencepiece_bpe import SentencePieceBPE, is_sentencepiece_json
from engine.model.tokenizer.sentencepiece_model import read_sentencepiece_model
from engine.model.tokenizer.tekken import read_tekken


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a GGUF file, or of a checkpoint directory: its tokenizer.json, else tekken.json, else
    tokenizer.model (None when it has none). A model that carries no chat template gets the shipped one of its
    architecture (model_type) where one fits."""
    path = Path(path)
    if not path.is_dir():
        return tokenizer_from_gguf(GGUFReader(path))
    tok = _from_directory(path)
    if tok is not None and tok.chat_template is None:
        config = path / "config.json"
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
        tok.chat_template = _shipped_template(tok, model_type)
    return tok


def _shipped_template(tok: Tokenizer, architecture: str | None) -> str | None:
    return template_for(architecture, lambda text: len(tok.encode(text)) == 1)


def _from_directory(path: Path) -> Tokenizer | None:
    config = TokenizerConfig.read(path)
    if (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path / "tokenizer.json", config)
    if (path / "tekken.json").is_file():
        return read_tekken(
            path / "tekken.json", add_bos_token=config.add_bos_token is not False, chat_template=config.chat_template
        )
    model_file = next(
        (f for f in [path / "tokenizer.model", *sorted(path.glob("tokenizer.model.v*"))] if f.is_file()), None
    )
    if model_file is not None:
        spm = read_sentencepiece_model(model_file)
        ids = {p: i for i, p in enumerate(spm.pieces)}
        return SentencePieceBPE.from_pieces(
            spm.pieces,
            spm.scores,
            spm.types,
            add_dummy_prefix=spm.add_dummy_prefix,
            bos_token_id=ids.get(config.bos_token, spm.bos_id),
            eos_token_id=ids.get(config.eos_token, spm.eos_id),
            add_bos_token=config.add_bos_token is not False,
            chat_template=config.chat_template,
        )
    return None


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer in an open GGUF (shared with the weight loader): byte-level BPE ("gpt2") or SentencePiece
    ("llama"); without a chat template, the shipped one of its general.architecture where one fits."""
    tok = _gguf_tokenizer(reader)
    if tok.chat_template is None:
        arch = reader.fields.get("general.architecture")
        tok.chat_template = _shipped_template(tok, None if arch is None else str(arch.contents()))
    return tok


def _gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    def field(key: str, default=None):
        value = reader.fields.get(key)
        return default if value is None else value.contents()

    model = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    types = [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))]
    sentencepiece = model == "llama"
    common = {
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id", 1 if sentencepiece else 0)),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id", 2 if sentencepiece else 0)),
        "chat_template": field("tokenizer.chat_template"),
    }
    if model == "gpt2":
        return ByteLevelBPE.from_gpt2_tokens(
            tokens,
            types,
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
            name=str(field("general.name", "gguf")),
            pattern=gguf_pretokenizer_pattern(field("tokenizer.ggml.pre")),
            **common,
        )
    if sentencepiece:
        # llama.cpp (and transformers) put BOS first in a SentencePiece vocabulary's prompts unless the file says not.
        return SentencePieceBPE.from_pieces(
            tokens,
            [float(s) for s in field("tokenizer.ggml.scores", [0.0] * len(tokens))],
            types,
            add_dummy_prefix=bool(field("tokenizer.ggml.add_space_prefix", True)),
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", True)),
            **common,
        )
    raise ValueError(
        f"unsupported GGUF tokenizer model {model!r}: byte-level BPE ('gpt2') and SentencePiece ('llama') are"
    )


@dataclass(frozen=True)
class TokenizerConfig:
    """What a checkpoint directory's tokenizer_config.json (and chat_template.jinja) say about its tokenizer."""

    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool | None = None  # None: the tokenizer's own default
    chat_template: str | None = None

    @classmethod
    def read(cls, path: Path) -> TokenizerConfig:
        file = path / "tokenizer_config.json"
        cfg = json.loads(file.read_text()) if file.is_file() else {}

        def content(value) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        # transformers saves the template beside the config these days; it wins, as in transformers.
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else pick_template(cfg.get("chat_template"))
        add_bos = cfg.get("add_bos_token")
        return cls(
            content(cfg.get("bos_token")),
            content(cfg.get("eos_token")),
            bool(add_bos) if add_bos is not None else None,
            template,
        )


def _from_tokenizer_json(file: Path, config: TokenizerConfig) -> Tokenizer:
    spec = json.loads(file.read_text())
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    sentencepiece = is_sentencepiece_json(spec)
    # Without a config, the conventional names: Llama's and Mistral's <s>, Gemma's <bos>.
    bos = ids.get(config.bos_token, ids.get("<s>", ids.get("<bos>", 0)) if sentencepiece else 0)
    eos = ids.get(config.eos_token, ids.get("</s>", ids.get("<eos>", 0)) if sentencepiece else 0)
    add_bos = config.add_bos_token
    if add_bos is None:
        add_bos = _post_processor_adds(spec.get("post_processor"), _token_text(ids, bos))
    common = {"bos_token_id": bos, "eos_token_id": eos, "add_bos_token": add_bos, "chat_template": config.chat_template}
    try:
        if sentencepiece:
            return SentencePieceBPE(Backend.from_file(str(file)), **common)
        return ByteLevelBPE.from_hf_json(spec, name=file.parent.name, **common)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def _token_text(ids: dict[str, int], token_id: int) -> str | None:
    return next((t for t, i in ids.items() if i == token_id), None)


def _post_processor_adds(processor: dict | None, bos: str | None) -> bool:
    """Whether a tokenizer.json's post-processor puts `bos` first in a single sequence (Llama 3's, Llama 2's)."""
    if not processor:
        return False
    if processor.get("type") == "Sequence":
        return any(_post_processor_adds(p, bos) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing" or not processor.get("single"):
        return False
    first = processor["single"][0]
    return "SpecialToken" in first and first["SpecialToken"].get("id") == bos
