"""Byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2, Mistral's Tekken) encoding with tiktoken, exactly as
Hugging Face `tokenizers` (or mistral-common, for Tekken) encodes."""

from __future__ import annotations

import re
from itertools import pairwise

import regex
import tiktoken

from engine.model.tokenizer.protocol import Tokenizer

TOKEN_TYPE_CONTROL = 3

# Rust's char::is_numeric, which HF's Digits pre-tokenizer uses, knows Unicode 17; tiktoken's (and HF's own regex)
# \p{N} stops at Unicode 16. These are the numerics in between, so they too stand alone as digits.
UNICODE_17_NUMERICS = r"\U00011de0-\U00011de9\U00016ff4-\U00016ff6"


def pretokenize_pattern(letters: str = r"\p{L}", numerics: str = r"\p{N}" + UNICODE_17_NUMERICS) -> str:
    """SmolLM2's pre-tokenizer, Digits(individual_digits=True) then GPT-2's ByteLevel regex, as one regex."""
    # Every numeric stands alone (so ` ?\p{N}+` becomes a bare class), and since the digit split ends a piece,
    # whitespace right before a numeric must pass GPT-2's `\s+(?!\S)` as if the text ended there.
    return (
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+|[{numerics}]| ?[^\s{letters}{numerics}]+"
        rf"|\s+(?![^\s{numerics}])|\s+"
    )


# Byte-level BPE pre-tokenizer regexes of the other families, as their tokenizer.json (or tekken.json) files give them.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TEKKEN_PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# GGUF `tokenizer.ggml.pre` -> the regex (None: SmolLM2's, also for files that name none).
GGUF_PRE_PATTERNS = {
    "llama-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "tekken": TEKKEN_PATTERN,
    "smollm": None,
    None: None,
}


def gguf_pretokenizer_pattern(pre: str | None) -> str | None:
    """The regex of a GGUF's `tokenizer.ggml.pre` (None: SmolLM2's)."""
    if pre not in GGUF_PRE_PATTERNS:
        known = ", ".join(sorted(p for p in GGUF_PRE_PATTERNS if p))
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}: supported are {known}")
    return GGUF_PRE_PATTERNS[pre]


def hf_pretokenizer_pattern(pre: dict | None) -> str | None:
    """The one regex a tokenizer.json's pre-tokenizer splits by (None: SmolLM2's digits + GPT-2 style)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    splits = [s for s in steps if s.get("type") == "Split"]
    byte_level = next((s for s in steps if s.get("type") == "ByteLevel"), None)
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return None
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return GPT2_PATTERN
    if (
        len(splits) == 1
        and byte_level
        and not byte_level.get("use_regex", True)
        and splits[0].get("behavior") == "Isolated"
        and "Regex" in splits[0].get("pattern", {})
    ):
        return splits[0]["pattern"]["Regex"]
    raise ValueError(
        f"unsupported pre-tokenizer {kinds}: byte-level BPE with one Split regex, GPT-2's ByteLevel "
        "regex, or digits + ByteLevel are"
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ByteLevelBPE(Tokenizer):
    """Byte-level BPE whose token ids are its merge ranks, on tiktoken."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        special: dict[str, int],
        *,
        bos_token_id: int,
        eos_token_id: int,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        name: str = "bpe",
        pattern: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`ranks`: each ordinary token's bytes -> its id, which is its BPE rank; `special`: each special token's text
        -> its id. `pattern` is the pre-tokenizer's regex (None: SmolLM2's)."""
        vocab_size = vocab_size or max([*ranks.values(), *special.values()]) + 1
        token_bytes = [b""] * vocab_size
        for t, i in special.items():
            token_bytes[i] = t.encode()
        for t, i in ranks.items():
            token_bytes[i] = t
        super().__init__(
            token_bytes,
            frozenset(special.values()),
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos_token=add_bos_token,
            chat_template=chat_template,
        )
        self._special_tokens = special
        ranks = dict(ranks)
        # tiktoken panics on a byte it has no rank for. encode() keeps such bytes away from it, dropping them as
        # Hugging Face's BPE (no unk token) does; ranks past the vocabulary are a guard, never merged or emitted.
        self.unknown_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        for n, b in enumerate(self.unknown_bytes):
            ranks[bytes([b])] = vocab_size + n
        self.pattern = pattern
        self._encoding = tiktoken.Encoding(
            name, pat_str=pattern or pretokenize_pattern(), mergeable_ranks=ranks, special_tokens=special
        )
        unknown_chars = "".join(re.escape(chr(b)) for b in self.unknown_bytes if b < 0x80)
        # A missing lead byte (0xf1, 0xf2) can only come from code points U+40000..U+BFFFF; 0xc0, 0xc1 and 0xf5..0xff
        # never occur in UTF-8.
        lead_ranges = "".join(
            f"{chr((b & 0x07) << 18)}-{chr(((b & 0x07) << 18) | 0x3FFFF)}"
            for b in self.unknown_bytes
            if 0xF0 <= b <= 0xF4
        )
        self._unknown_char_re = re.compile(f"[{unknown_chars}{lead_ranges}]") if unknown_chars or lead_ranges else None
        alternatives = "|".join(map(re.escape, sorted(special, key=len, reverse=True)))
        self._special_split_re = re.compile(f"({alternatives})" if special else "(?!)")
        self._pretokenize_re: regex.Pattern | None = None

    @classmethod
    def from_gpt2_tokens(cls, tokens: list[str], token_types: list[int], **kwargs) -> ByteLevelBPE:
        """From token strings in GPT-2's byte-to-character spelling (GGUF, tokenizer.json); ids are their positions,
        already BPE ranks. Control-type tokens are special."""
        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        special = {t: i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == TOKEN_TYPE_CONTROL}
        ranks = {
            bytes(char_to_byte[c] for c in t): i
            for i, (t, kind) in enumerate(zip(tokens, token_types))
            if kind != TOKEN_TYPE_CONTROL
        }
        return cls(ranks, special, vocab_size=len(tokens), **kwargs)

    @classmethod
    def from_hf_json(cls, spec: dict, **kwargs) -> ByteLevelBPE:
        """From a parsed byte-level BPE tokenizer.json whose ids are merge ranks; added tokens are special."""
        vocab: dict[str, int] = dict(spec["model"]["vocab"])
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
        types = [1] * len(tokens)
        for t, i in vocab.items():
            tokens[i] = t
        for t, i in added.items():
            tokens[i], types[i] = t, TOKEN_TYPE_CONTROL
        merged = [vocab["".join(m.split(" ", 1) if isinstance(m, str) else m)] for m in spec["model"].get("merges", [])]
        if any(a >= b for a, b in pairwise(merged)):
            raise ValueError("token ids are not in merge order, so they cannot serve as BPE ranks")
        return cls.from_gpt2_tokens(tokens, types, pattern=hf_pretokenizer_pattern(spec.get("pre_tokenizer")), **kwargs)

    def _encode(self, text: str) -> list[int]:
        if self._unknown_char_re is None or not self._unknown_char_re.search(text):
            return self._encoding.encode(text, allowed_special="all")
        return self._encode_dropping_unknown(text)

    def _encode_dropping_unknown(self, text: str) -> list[int]:
        # Hugging Face drops a tokenless byte inside a piece and merges its neighbours as if it were not there;
        # tiktoken would keep it as a barrier, so these (rare) texts get their pieces split here and BPE'd one by one.
        if self._pretokenize_re is None:
            # The `regex` module's Unicode tables are newer than tiktoken's; spelling out tiktoken's own \p{L} and
            # \p{N} keeps both splitters in agreement.
            self._pretokenize_re = regex.compile(
                self.pattern
                or pretokenize_pattern(_class_ranges(r"\p{L}"), _class_ranges(r"\p{N}" + UNICODE_17_NUMERICS))
            )
        ids: list[int] = []
        for n, segment in enumerate(self._special_split_re.split(text)):
            if n % 2:
                ids.append(self._special_tokens[segment])
                continue
            for piece in self._pretokenize_re.findall(segment):
                kept = bytes(b for b in piece.encode() if b not in self.unknown_bytes)
                if kept:
                    ids.extend(self._encoding._encode_single_piece(kept))
        return ids

    def decode_bytes(self, ids: list[int], skip_special_tokens: bool = False) -> bytes:
        """Concatenated bytes of `ids`; ids outside the vocabulary (dummy models have larger ones) are skipped."""
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        return b"".join(self._token_bytes[i] for i in ids if 0 <= i < self.vocab_size and i not in skip)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")


def _class_ranges(char_class: str) -> str:
    """The code points tiktoken's regex puts in `char_class`, as ranges for a character class of the `regex` module."""
    byte_ranks = {bytes([b]): b for b in range(256)}
    probe = tiktoken.Encoding("class-probe", pat_str=f"[{char_class}]+", mergeable_ranks=byte_ranks, special_tokens={})
    every_char = "".join(map(chr, [*range(0xD800), *range(0xE000, 0x110000)]))
    members = [ord(c) for c in probe.decode(probe.encode_ordinary(every_char))]
    ranges = []
    for cp in members:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)
