"""Tokenizers: one interface (`Tokenizer`) over byte-level BPE on tiktoken (GPT-2 style, Tekken) and
SentencePiece-style BPE on Hugging Face `tokenizers`, and `load_tokenizer`, which picks one from a checkpoint.

Imports without torch: the gateway tokenizes and detokenizes.
"""

from engine.model.tokenizer.byte_level import (
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    TEKKEN_PATTERN,
    ByteLevelBPE,
    bytes_to_unicode,
    hf_pretokenizer_pattern,
)
from engine.model.tokenizer.loading import load_tokenizer, tokenizer_from_gguf
from engine.model.tokenizer.protocol import Tokenizer
from engine.model.tokenizer.sentencepiece_bpe import SentencePieceBPE

_bytes_to_unicode = bytes_to_unicode  # the name tests/test_families.py imports

__all__ = [
    "GPT2_PATTERN",
    "LLAMA3_PATTERN",
    "QWEN2_PATTERN",
    "TEKKEN_PATTERN",
    "ByteLevelBPE",
    "SentencePieceBPE",
    "Tokenizer",
    "bytes_to_unicode",
    "hf_pretokenizer_pattern",
    "load_tokenizer",
    "tokenizer_from_gguf",
]
