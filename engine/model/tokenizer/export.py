"""A byte-level BPE tokenizer written out as Hugging Face files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json), so that clients that count tokens with `transformers.AutoTokenizer` (lm-eval, aiperf,
guidellm: `--tokenizer DIR`) encode exactly as the server does."""

from __future__ import annotations

import json
from pathlib import Path

from engine.model.tokenizer.byte_level import GPT2_PATTERN, ByteLevelBPE, bytes_to_unicode
from engine.model.tokenizer.protocol import Tokenizer


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges a rank table implies (ids are ranks): each token is the merge of the two parts BPE reaches with
    only lower-ranked merges, as Hugging Face's tiktoken converter recovers them."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _pre_tokenizer(pattern: str | None) -> dict:
    if pattern is None:  # SmolLM2's: every digit alone, then GPT-2's ByteLevel regex
        return {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        }
    if pattern == GPT2_PATTERN:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def tokenizer_json(tok: ByteLevelBPE) -> dict:
    """The tokenizer.json of a byte-level BPE tokenizer."""
    spell = bytes_to_unicode()
    text = lambda b: "".join(spell[x] for x in b)
    ranks = {t: i for t, i in tok._encoding._mergeable_ranks.items() if i < tok.vocab_size}
    special = sorted(tok.special_token_ids)
    bos = tok.token_bytes(tok.bos_token_id).decode()
    post = (
        {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_token_id], "tokens": [bos]}},
        }
        if tok.add_bos_token
        else {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok.token_bytes(i).decode(),
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in special
        ],
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(tok.pattern),
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(
                sorted(
                    {
                        **{text(t): i for t, i in ranks.items()},
                        **{tok.token_bytes(i).decode(): i for i in special},
                    }.items(),
                    key=lambda item: item[1],
                )
            ),
            "merges": [[text(a), text(b)] for a, b in _merges(ranks)],
        },
    }


def export_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> list[Path]:
    """Write the three files into `out`; returns their paths. Byte-level BPE only (a SentencePiece model's own
    tokenizer.model is what Hugging Face loads for those)."""
    if not isinstance(tok, ByteLevelBPE):  # a ValueError: the CLI reports it as the model's, not a bug
        raise ValueError(  # noqa: TRY004
            f"export-tokenizer writes byte-level BPE tokenizers; this model's is {type(tok).__name__}"
        )
    out.mkdir(parents=True, exist_ok=True)
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": tok.add_bos_token,
        "clean_up_tokenization_spaces": False,
        **special,
        "additional_special_tokens": [
            tok.token_bytes(i).decode()
            for i in sorted(tok.special_token_ids)
            if i not in (tok.bos_token_id, tok.eos_token_id)
        ],
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    files = {"tokenizer.json": tokenizer_json(tok), "tokenizer_config.json": config, "special_tokens_map.json": special}
    paths = []
    for name, body in files.items():
        path = out / name
        path.write_text(json.dumps(body, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None))
        paths.append(path)
    return paths
