"""Chat templates: compiled in the sandboxed jinja2 environment transformers renders them in; and the templates
shipped for models that carry none, chosen by architecture."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

SHIPPED_DIR = Path(__file__).parent / "templates"
# Each shipped template's special-token texts: it fits a vocabulary that has each as one token.
MARKERS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral-v1": (),  # [INST] as text: Llama 2's vocabulary and Mistral's first
    "mistral-v3": ("[INST]", "[/INST]"),
    "phi3": ("<|user|>", "<|assistant|>", "<|end|>"),
}
SHIPPED = tuple(sorted(MARKERS))
# A GGUF's general.architecture (a checkpoint's model_type) -> the shipped templates it may speak, the first that fits
# its vocabulary chosen: a Llama fine-tune may speak ChatML (SmolLM2 does) or Mistral's turns.
BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "llama": ("llama3", "chatml", "mistral-v3", "mistral-v1"),
    "mistral": ("chatml", "mistral-v3", "mistral-v1"),
    "qwen2": ("chatml",),
    "gemma2": ("gemma",),
    "gemma3": ("gemma",),
    "gemma3_text": ("gemma",),
    "phi3": ("phi3",),
}


class NoChatTemplateError(ValueError):
    """The model carries no chat template, none was given, and no shipped one fits it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def pick_template(value: str | list | None) -> str | None:
    """A tokenizer_config.json `chat_template`: one template, or a list of named ones (the "default" is used)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


def shipped_template(name: str) -> str:
    """The text of the shipped template `name` (one of SHIPPED)."""
    return (SHIPPED_DIR / f"{name}.jinja").read_text()


def template_for(architecture: str | None, is_token: Callable[[str], bool]) -> str | None:
    """The shipped template for a model of `architecture` that carries none (None: none fits); `is_token(text)`:
    whether the vocabulary has `text` as one token."""
    for name in BY_ARCHITECTURE.get(architecture or "", ()):
        if all(is_token(marker) for marker in MARKERS[name]):
            return shipped_template(name)
    return None


def load_chat_template(file_or_name: str) -> str:
    """--chat-template: a shipped template's name or a Jinja file's path, read and compiled (ValueError if neither,
    or if it does not compile)."""
    if file_or_name in SHIPPED:
        return shipped_template(file_or_name)
    path = Path(file_or_name).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template {file_or_name!r} is neither a file nor a shipped template ({', '.join(SHIPPED)})"
        )
    source = path.read_text()
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {file_or_name}: line {e.lineno}: {e.message}") from None
    return source
