"""Varied texts for comparing tokenizers with their reference libraries: prose, code, digits, many scripts, emoji,
whitespace runs, control characters and special-token text; and the check of an echoed prompt's tokens on them."""

from __future__ import annotations

import random

from gateway.api.completions import _echoed_tokens

FRAGMENTS = [
    # prose and contractions
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm",
    "they'LL",
    "we've",
    "She'd",
    "it's",
    "don't",
    "y'all",
    "'s'S't",
    "O'Neil's",
    "rock 'n' roll",
    '"quoted" text',
    "Mr. Smith -- Jr.",
    "e.g., i.e.",
    "ALL CAPS SHOUTING",
    "camelCaseWord",
    "snake_case_name",
    "naïve café résumé",
    "Straße",
    "ﬁne ligature",
    # code
    "def f(x):\n    return x * 2\n",
    "\tif (a && b) {\n\t\treturn;\n\t}\n",
    "for i in range(10):\n\tprint(i)",
    "    indented   line   ",
    "x = [1, 2, 3]  # comment",
    "#include <stdio.h>",
    "SELECT * FROM t WHERE id=42;",
    "fn main() -> Result<(), Box<dyn Error>> {}",
    "a->b; c::d; e=>f",
    "if x != y: pass",
    '<div class="a">b</div>',
    # digits after whitespace, numbers
    "a   1234",
    "\t\t42",
    "  7",
    "\n\n99 bottles",
    "x 1",
    "x  12",
    "2024-01-15",
    "3.14159",
    "1,234,567.89",
    "-0.5e10",
    "0xDEADBEEF",
    "v1.2.3",
    "$100",
    "50%",
    "1/2",
    "10:30pm",
    "007",
    "12345678901234567890",
    "( 1 )",
    "[ 2, 3 ]",
    "a1b2c3",
    "   \t 5",
    "phone: +1 (555) 123-4567",
    # unicode numerics
    "²",
    "x² + y³",
    "٣٤٥",
    "½ cup",
    "①②③",
    "Ⅻ",
    "〇",
    "𝟙𝟚",
    " ٣",
    "  ½",
    "१२३",
    "๑๒",
    "፲",
    "🄁",
    "\U00011de0\U00011de9",
    "a \U00016ff4",
    "  \U00011de5x",
    # emoji
    "😀",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "🇯🇵",
    "❤️",
    "I ❤️ NY",
    " 🎉🎉",
    "✅ done",
    "🤷🏻‍♀️",
    # scripts
    "日本語のテキスト",
    "中文字符测试",
    "한국어 텍스트입니다",
    "안녕하세요",
    "مرحبا بالعالم",
    "العربية ١٢٣",
    "हिन्दी पाठ",
    "नमस्ते दुनिया",
    "Привет, мир!",
    "Ελληνικά",
    "עברית",
    "ไทย",
    "ქართული",
    "Tiếng Việt",
    "e\u0301",
    "a\u0308\u0304",
    "\ufeffBOM",
    "zero\u200bwidth",
    "non\u00a0breaking",
    "ideo\u3000space",
    # whitespace
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\r\n\r\n",
    " \n ",
    "\n\n\n",
    "\t \t",
    "trailing   ",
    "   leading",
    "a \t\nb",
    "line1\nline2\r\nline3",
    "x\x0by\x0cz",
    "a\x85b",
    "\u2028\u2029",
    " \u3000 ",
    "end\n",
    # special-token text
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "<|im_start|><|im_end|>",
    "a<repo_name>b",
    "<file_sep>x.py",
    "<|im_start|> spaced <|im_end|>\n",
    "<|im_start",
    "<|notatoken|>",
    "<jupyter_code>1",
    # control bytes
    "\x00",
    "\x01",
    "\x7f",
    "\x1b[31mred\x1b[0m",
    "\x1c\x1d\x1e\x1f",
    "bell\x07",
    "\x08back",
    # URLs, JSON, markup
    "https://example.com/path?q=1&r=two#frag",
    "mailto:a@b.co",
    "http://[::1]:8080/",
    '{"a": 1, "b": [true, null]}',
    "{'key': 'value'}",
    "**bold** _it_",
    "| a | b |\n|---|---|",
    "<!-- c -->",
    "C:\\Users\\x",
    "~/.config/app",
    # tokenless bytes in context
    "a\x04b",
    " \x04!",
    "!\x04!",
    " \x04's",
    "\x04's",
    "x\x1d y",
    "\x06\x06",
    "Hello\x04 world\x16!",
    " \x13 \x14 ",
    "ab \x04 cd",
    "1\x042",
    " \U00040000!",
    "\U00040000x",
    "\U000bfffd\U00080000\x06",
    "é\x13é",
    "",
]

_GLUE = ["", " ", "  ", "\n", "\t", "   ", "\r\n", " \n"]


def _random_text(rng: random.Random) -> str:
    pools = [
        (0x20, 0x7E),
        (0x00, 0x1F),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x400, 0x4FF),
        (0x600, 0x6FF),
        (0x900, 0x97F),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F6FF),
        (0x2000, 0x206F),
        (0xFF00, 0xFFEF),
        (0x1D400, 0x1D7FF),
        (0x40000, 0x40010),
        (0xBFFF0, 0xBFFFD),
    ]
    chars = []
    for _ in range(rng.randint(1, 40)):
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


# Code points of every plane and block the byte-fallback and byte-level paths must survive, whitespace runs
# included (SentencePiece merges them into "▁▁..." pieces of tied scores).
_POOLS = [
    (0x20, 0x7E),
    (0x00, 0x1F),
    (0xA0, 0x24F),
    (0x300, 0x36F),
    (0x400, 0x4FF),
    (0x600, 0x6FF),
    (0x900, 0x97F),
    (0x3040, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF),
    (0x2000, 0x206F),
    (0xFF00, 0xFFEF),
    (0x1D400, 0x1D7FF),
    (0x2580, 0x25FF),
    (0x10000, 0x10FFFF),
    (0xE000, 0xF8FF),
]


def varied_texts(special: list[str], n: int, seed: int) -> list[str]:
    """FRAGMENTS, then `n` texts: fragments glued with whitespace and `special` token texts, random code points and
    whitespace runs, and leading-space variants."""
    rng = random.Random(seed)
    texts = list(FRAGMENTS)
    pieces = FRAGMENTS + special * 4
    for k in range(n):
        kind = k % 3
        if kind == 0:
            texts.append("".join(rng.choice(pieces) + rng.choice(_GLUE) for _ in range(rng.randint(1, 6))))
        elif kind == 1:
            chars = []
            for _ in range(rng.randint(1, 50)):
                lo, hi = rng.choice(_POOLS)
                c = chr(rng.randint(lo, hi))
                chars.append(
                    " " * rng.randint(1, 20) if rng.random() < 0.15 else "x" if 0xD800 <= ord(c) < 0xE000 else c
                )
            texts.append("".join(chars))
        else:
            texts.append(
                rng.choice(["", " ", "  ", "\n", "\t", " " * rng.randint(3, 40)])
                + rng.choice(pieces)
                + rng.choice(_GLUE)
            )
    return texts


def assert_echo_slices(tok, sent: str | list[int], ids: list[int], echo: str) -> None:
    """An echoed prompt's tokens and offsets (completions' echo with logprobs): each token's text is the echo's slice
    from its offset to the next one's, and the slices cover the echo. Exempt: the BOS the tokenizer added (not in
    the echo, at 0) and a token ending inside a character (shown as bytes)."""
    tokens, offsets = _echoed_tokens(tok, sent, echo, ids)
    assert len(tokens) == len(offsets) == len(ids)
    added = isinstance(sent, str) and ids[:1] == [tok.bos_token_id] and not sent.startswith(tok.bos_token)
    assert offsets == sorted(offsets) and offsets[:1] == [0]
    ends = [*offsets[1:], len(echo)]
    for k, (token, start, end) in enumerate(zip(tokens, offsets, ends)):
        if not (k == 0 and added) and not token.startswith("bytes:"):
            assert echo[start:end] == token, (sent, k, tokens, offsets)
