"""Byte-level BPE tokenizer read from a GGUF file, encoding with tiktoken like Hugging Face `tokenizers` does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import regex
import tiktoken

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


# Byte-level BPE pre-tokenizer regexes of the other families, as their tokenizer.json files give them.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
GGUF_PRE_PATTERNS = {"llama-bpe": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN, "gpt-2": GPT2_PATTERN}


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
    if (len(splits) == 1 and byte_level and not byte_level.get("use_regex", True)
            and splits[0].get("behavior") == "Isolated" and "Regex" in splits[0].get("pattern", {})):
        return splits[0]["pattern"]["Regex"]
    raise ValueError(f"unsupported pre-tokenizer {kinds}: byte-level BPE with one Split regex, GPT-2's ByteLevel "
                     "regex, or digits + ByteLevel are")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _field_value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class Tokenizer:
    """Encode text to token ids and back; render chat prompts with the model's template."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        *,
        bos_token_id: int,
        eos_token_id: int,
        chat_template: str | None = None,
        name: str = "gguf",
        pattern: str | None = None,
    ) -> None:
        """`tokens` are GGUF token strings in GPT-2 byte-level form; ids are their positions, already BPE ranks.
        `pattern` is the pre-tokenizer's regex (None: SmolLM2's)."""
        char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        self.vocab_size = len(tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        special = {t: i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == TOKEN_TYPE_CONTROL}
        ranks = {
            bytes(char_to_byte[c] for c in t): i
            for i, (t, kind) in enumerate(zip(tokens, token_types))
            if kind != TOKEN_TYPE_CONTROL
        }
        self.special_token_ids = frozenset(special.values())
        self._special_tokens = special
        self._token_bytes = [t.encode() if i in self.special_token_ids else b"" for i, t in enumerate(tokens)]
        for token, i in ranks.items():
            self._token_bytes[i] = token
        # tiktoken panics on a byte it has no rank for. encode() keeps such bytes away from it, dropping them as
        # Hugging Face's BPE (no unk token) does; ranks past the vocabulary are a guard, never merged or emitted.
        self.unknown_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        for n, b in enumerate(self.unknown_bytes):
            ranks[bytes([b])] = self.vocab_size + n
        self.pattern = pattern
        self._encoding = tiktoken.Encoding(name, pat_str=pattern or pretokenize_pattern(), mergeable_ranks=ranks,
                                           special_tokens=special)
        unknown_chars = "".join(re.escape(chr(b)) for b in self.unknown_bytes if b < 0x80)
        # A missing lead byte (0xf1, 0xf2) can only come from code points U+40000..U+BFFFF; 0xc0, 0xc1 and 0xf5..0xff
        # never occur in UTF-8.
        lead_ranges = "".join(f"{chr((b & 0x07) << 18)}-{chr(((b & 0x07) << 18) | 0x3FFFF)}"
                              for b in self.unknown_bytes if 0xF0 <= b <= 0xF4)
        self._unknown_char_re = re.compile(f"[{unknown_chars}{lead_ranges}]") if unknown_chars or lead_ranges else None
        alternatives = "|".join(map(re.escape, sorted(special, key=len, reverse=True)))
        self._special_split_re = re.compile(f"({alternatives})" if special else "(?!)")
        self._pretokenize_re: regex.Pattern | None = None
        self._template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build from an open GGUF reader (shared with the weight loader)."""
        model = _field_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model!r}: only byte-level BPE ('gpt2') is implemented")
        tokens = _field_value(reader, "tokenizer.ggml.tokens")
        types = _field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        return cls(
            tokens,
            [int(t) for t in types],
            bos_token_id=int(_field_value(reader, "tokenizer.ggml.bos_token_id", 0)),
            eos_token_id=int(_field_value(reader, "tokenizer.ggml.eos_token_id", 0)),
            chat_template=_field_value(reader, "tokenizer.chat_template"),
            name=str(_field_value(reader, "general.name", "gguf")),
            pattern=GGUF_PRE_PATTERNS.get(_field_value(reader, "tokenizer.ggml.pre")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face `tokenizer.json` of the same byte-level BPE kind (ids must be merge ranks)."""
        path = Path(path)
        spec = json.loads((path / "tokenizer.json").read_text())
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        vocab: dict[str, int] = dict(spec["model"]["vocab"])
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
        types = [1] * len(tokens)
        for t, i in vocab.items():
            tokens[i] = t
        for t, i in added.items():
            tokens[i], types[i] = t, TOKEN_TYPE_CONTROL
        merged = [vocab["".join(m.split(" ", 1) if isinstance(m, str) else m)] for m in spec["model"].get("merges", [])]
        if any(a >= b for a, b in zip(merged, merged[1:])):
            raise ValueError(f"{path}: token ids are not in merge order, so they cannot serve as BPE ranks")

        def token_id(key: str, default: int) -> int:
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return added.get(value, vocab.get(value, default)) if value else default

        return cls(
            tokens, types, bos_token_id=token_id("bos_token", 0), eos_token_id=token_id("eos_token", 0),
            chat_template=cfg.get("chat_template"), name=path.name,
            pattern=hf_pretokenizer_pattern(spec.get("pre_tokenizer")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file path."""
        return cls.from_gguf(gguf.GGUFReader(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" becomes its special id."""
        if self._unknown_char_re is None or not self._unknown_char_re.search(text):
            return self._encoding.encode(text, allowed_special="all")
        return self._encode_dropping_unknown(text)

    def _encode_dropping_unknown(self, text: str) -> list[int]:
        # Hugging Face drops a tokenless byte inside a piece and merges its neighbours as if it were not there;
        # tiktoken would keep it as a barrier, so these (rare) texts get their pieces split here and BPE'd one by one.
        if self._pretokenize_re is None:
            # The `regex` module's Unicode tables are newer than tiktoken's; spelling out tiktoken's own \p{L} and
            # \p{N} keeps both splitters in agreement.
            self._pretokenize_re = regex.compile(self.pattern or pretokenize_pattern(
                _class_ranges(r"\p{L}"), _class_ranges(r"\p{N}" + UNICODE_17_NUMERICS)))
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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (the literal text for a special token)."""
        return self._token_bytes[token_id]

    @property
    def bos_token(self) -> str:
        return self._token_bytes[self.bos_token_id].decode("utf-8", errors="replace")

    @property
    def eos_token(self) -> str:
        return self._token_bytes[self.eos_token_id].decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render `messages` (and `tools`, for templates that take them) with the model's chat template, as
        transformers' apply_chat_template(tokenize=False)."""
        if self.chat_template is None:
            raise ValueError("the model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template describes tools itself (it reads a `tools` variable)."""
        return self.chat_template is not None and re.search(r"\btools\b", self.chat_template) is not None


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


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)
