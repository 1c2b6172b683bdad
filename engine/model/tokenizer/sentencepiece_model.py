"""A SentencePiece `tokenizer.model` read into its pieces, scores and types (the protobuf wire format, read here:
the fields needed are few, and `sentencepiece`'s own reader would add protobuf to the gateway's dependencies)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# SentencePiece piece types; GGUF's tokenizer.ggml.token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2


@dataclass(frozen=True)
class SentencePieceVocab:
    """What a SentencePiece BPE tokenizer is made of."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    add_dummy_prefix: bool = True  # a text gets a leading "▁" (a space) before it is split
    bos_id: int = 1
    eos_id: int = 2


def read_sentencepiece_model(path: str | Path) -> SentencePieceVocab:
    """Read a `tokenizer.model`; only BPE with byte fallback and no normalization rules (Llama, Mistral, Gemma)."""
    pieces, scores, types = [], [], []
    trainer: dict[int, object] = {}
    normalizer: dict[int, object] = {}
    for number, value in _fields(Path(path).read_bytes()):
        if number == 1:  # ModelProto.pieces
            piece = dict(_fields(value))
            pieces.append(bytes(piece.get(1, b"")).decode())
            scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
            types.append(piece.get(3, NORMAL))
        elif number == 2:  # ModelProto.trainer_spec
            trainer = dict(_fields(value))
        elif number == 3:  # ModelProto.normalizer_spec
            normalizer = dict(_fields(value))
    if trainer.get(3, 1) != _BPE:
        raise ValueError(f"{path}: only SentencePiece BPE models are supported (model_type is {trainer.get(3, 1)})")
    if not trainer.get(35, 0):
        raise ValueError(f"{path}: only SentencePiece BPE with byte_fallback is supported")
    if trainer.get(24, 0):
        raise ValueError(f"{path}: treat_whitespace_as_suffix is not supported")
    if normalizer.get(2) or normalizer.get(4, 1) or not normalizer.get(5, 1):
        raise ValueError(
            f"{path}: only the identity normalizer is supported (no precompiled_charsmap, "
            "remove_extra_whitespaces off, escape_whitespaces on)"
        )
    return SentencePieceVocab(
        pieces,
        scores,
        types,
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        bos_id=_signed(trainer.get(41, 1)),
        eos_id=_signed(trainer.get(42, 2)),
    )


def _fields(buf: bytes | memoryview) -> Iterator[tuple[int, object]]:
    """(field number, value) of one protobuf message: varints as ints, the rest as their raw bytes."""
    buf = memoryview(buf)
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"not a SentencePiece model: protobuf wire type {wire_type}")
        yield number, value


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _signed(value: int) -> int:
    """An int32 field's value (a negative one arrives as a 64-bit two's complement varint)."""
    return value - (1 << 64) if value >= 1 << 63 else value
