"""The one tokenizer interface the gateway and the engine use, whatever kind of tokenizer the checkpoint holds."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import jinja2

from engine.model.tokenizer.chat_template import NoChatTemplateError, compile_template


class Tokenizer(ABC):
    """Encode text to token ids and back, each token's bytes for streaming, and the model's chat template."""

    def __init__(
        self,
        token_bytes: list[bytes],
        special_token_ids: frozenset[int],
        *,
        bos_token_id: int,
        eos_token_id: int,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """`token_bytes[i]` is token i's text as raw bytes (a special token's literal text); its length is the
        vocabulary size. `add_bos_token`: a prompt encoded with add_special_tokens=True starts with BOS."""
        self._token_bytes = token_bytes
        self.vocab_size = len(token_bytes)
        self.special_token_ids = special_token_ids
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as "<s>" becomes its id. add_special_tokens=True (a
        completions prompt) puts BOS first where the tokenizer's config asks for it, unless the text already
        starts with it."""
        ids = self._encode(text)
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token text included, nothing added."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` exactly as the tokenizer's reference library decodes them; ids outside the vocabulary
        (dummy models have larger ones) are skipped."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token as it continues a text (a special token's literal text).

        Streamed text is these bytes in order. It equals decode() except where a reference decode drops the
        leading space of a text's first word (SentencePiece): a generated token always continues a prompt.
        """
        return self._token_bytes[token_id]

    @property
    def bos_token(self) -> str:
        return self._token_bytes[self.bos_token_id].decode("utf-8", errors="replace")

    @property
    def eos_token(self) -> str:
        return self._token_bytes[self.eos_token_id].decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        """The Jinja source prompts are rendered with (None: the model has none)."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._chat_template = source
        self._template: jinja2.Template | None = None  # compiled on first use

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render `messages` (and `tools`, for templates that take them) with the model's chat template, as
        transformers' apply_chat_template(tokenize=False)."""
        if self.chat_template is None:
            raise NoChatTemplateError("the model has no chat template")
        if self._template is None:
            self._template = compile_template(self.chat_template)
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
