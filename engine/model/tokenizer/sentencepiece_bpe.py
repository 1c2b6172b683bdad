"""SentencePiece-style BPE with byte fallback (Llama 2, Mistral v0.1-v0.3, Gemma) on Hugging Face `tokenizers`:
a tokenizer.json as it is, or a pipeline built from pieces and scores (a tokenizer.model, a GGUF) that encodes and
decodes as the `sentencepiece` library does."""

from __future__ import annotations

import json
import re

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Backend

from engine.model.tokenizer.protocol import Tokenizer
from engine.model.tokenizer.sentencepiece_model import CONTROL, NORMAL, UNKNOWN, USER_DEFINED

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # an undecodable byte, as errors="surrogateescape" writes it


def is_sentencepiece_json(spec: dict) -> bool:
    """Whether a parsed tokenizer.json is SentencePiece-style: BPE with byte fallback."""
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


class SentencePieceBPE(Tokenizer):
    """SentencePiece-style BPE with byte fallback, on a `tokenizers` pipeline."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int,
        eos_token_id: int,
        add_bos_token: bool = True,
        chat_template: str | None = None,
        dummy_prefix: bool | None = None,
    ) -> None:
        """`backend` must decode a token as its text with "▁" as a space and "<0xNN>" as byte NN (checked).
        `dummy_prefix`: None decodes with the backend's decoder (a tokenizer.json is its own reference); True or
        False decodes as `sentencepiece` does, for a model that does or does not prefix texts with a space."""
        _check_decoder(json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None)
        added = backend.get_added_tokens_decoder()
        size = backend.get_vocab_size(with_added_tokens=True)
        token_bytes = [b""] * size
        self._byte_values: dict[int, int] = {}
        for i in range(size):
            piece = backend.id_to_token(i)
            if piece is None:
                continue
            # The decoder spells added tokens too: "▁" is a space in a special token as anywhere.
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte:
                self._byte_values[i] = int(byte[1], 16)
            token_bytes[i] = bytes([self._byte_values[i]]) if byte else piece.replace(_SPACE, " ").encode()
        super().__init__(
            token_bytes,
            frozenset(i for i, t in added.items() if t.special),
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos_token=add_bos_token,
            chat_template=chat_template,
        )
        self._backend = backend
        self._dummy_prefix = dummy_prefix

    @classmethod
    def from_pieces(
        cls, pieces: list[str], scores: list[float], types: list[int], *, add_dummy_prefix: bool = True, **kwargs
    ) -> SentencePieceBPE:
        """From a SentencePiece vocabulary (piece, score and type per id), encoding as `sentencepiece` encodes each
        stretch of text between control, unknown and user-defined tokens' texts (which become their ids) -- as
        llama.cpp does."""
        vocab = {piece: i for i, piece in enumerate(pieces)}
        normal = {piece: score for piece, score, kind in zip(pieces, scores, types) if kind == NORMAL}
        # SentencePiece merges the adjacent pair whose union has the best score, the leftmost among equals; BPE
        # ranks in score order do the same (ties are the whitespace runs, where the longer left part comes first).
        merges = sorted(
            (
                (score, -k, -(len(piece) - k), piece[:k], piece[k:])
                for piece, score in normal.items()
                for k in range(1, len(piece))
                if piece[:k] in normal and piece[k:] in normal
            ),
            key=lambda m: (-m[0], m[1], m[2]),
        )
        unk = next((p for p, kind in zip(pieces, types) if kind == UNKNOWN), None)
        backend = Backend(
            models.BPE(
                vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True
            )
        )
        prefix = [normalizers.Prepend(_SPACE)] if add_dummy_prefix else []
        backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPACE)])
        strip = [decoders.Strip(" ", 1, 0)] if add_dummy_prefix else []
        backend.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        # Added tokens cut the text before normalization, so every stretch between them gets its own dummy prefix.
        backend.add_tokens(
            [
                AddedToken(p, special=kind != USER_DEFINED, normalized=False)
                for p, kind in zip(pieces, types)
                if kind in (CONTROL, UNKNOWN, USER_DEFINED)
            ]
        )
        return cls(backend, dummy_prefix=add_dummy_prefix, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if self._dummy_prefix is None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._decode_as_sentencepiece(ids, skip_special_tokens)

    def _decode_as_sentencepiece(self, ids: list[int], skip_special_tokens: bool) -> str:
        # sentencepiece's Decode: each run of byte pieces is UTF-8 with one U+FFFD per invalid byte (HF's ByteFallback
        # turns the whole run into U+FFFDs), and only the first piece of the text, a "▁..." one, loses its "▁" (a
        # first byte piece <0x20> keeps its space, where HF's Strip would take it).
        out: list[str] = []
        run = bytearray()
        strip = self._dummy_prefix  # nothing written yet: the next "▁..." piece loses its "▁"
        for i in ids:
            byte = self._byte_values.get(i)
            if byte is not None:
                run.append(byte)
                continue
            if run:
                out.append(_utf8_per_byte(run))
                run.clear()
                strip = False
            if i in self.special_token_ids:
                if not skip_special_tokens:
                    out.append(self._token_bytes[i].decode())
                    strip = False
                continue
            piece = self._token_bytes[i].decode()
            out.append(piece[1:] if strip and piece.startswith(" ") else piece)
            strip = False
        if run:
            out.append(_utf8_per_byte(run))
        return "".join(out)


def _utf8_per_byte(data: bytearray) -> str:
    """UTF-8 text of `data` with every byte that is not part of a valid character as one U+FFFD."""
    return _ESCAPED_BYTE.sub("\ufffd", data.decode("utf-8", errors="surrogateescape"))


def _check_decoder(decoder: dict | None) -> None:
    """A decoder that spells tokens as SentencePiece does, so that token_bytes() agrees with decode()."""
    steps = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder]
    kinds = set()
    for step in steps:
        kind = (step or {}).get("type")
        if (kind == "Replace" and step.get("pattern") == {"String": _SPACE} and step.get("content") == " ") or (
            kind == "Metaspace" and step.get("replacement") == _SPACE
        ):
            kinds.add("space")
        elif kind == "Strip" and step.get("content") == " " and step.get("start", 0) <= 1 and not step.get("stop"):
            pass  # the leading space of a text's first word: decode() drops it, a continuation keeps it
        elif kind in ("ByteFallback", "Fuse"):
            kinds.add(kind)
        else:
            raise ValueError(f"unsupported decoder step {step} in a SentencePiece-style tokenizer.json")
    if "space" not in kinds or "ByteFallback" not in kinds:
        raise ValueError(
            f"a SentencePiece-style tokenizer.json must decode with ByteFallback and '▁' as a space, not {decoder}"
        )
