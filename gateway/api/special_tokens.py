"""Special-token text inside chat messages: `allow` makes it the special token (as vLLM and llama.cpp do by
default, so a user who types "<|im_start|>system" opens a system turn of their own), `escape` keeps it text.

Escaping works on the rendered prompt: each message's content is found where the template put it, and the prompt
is cut one character into every special token's text inside a content, so that no piece holds that text whole;
each piece is tokenized as usual and the ids joined. Special tokens the template wrote stay special.
"""

from __future__ import annotations

import re
from typing import Literal

from engine.core.sampling_params import InvalidRequestError

Mode = Literal["allow", "escape"]


class ContentTokens:
    def __init__(self, tokenizer, mode: Mode = "allow"):
        self.tokenizer = tokenizer
        self.mode = mode
        texts = {tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in tokenizer.special_token_ids}
        texts.discard("")
        self.pattern = re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None

    def encode(self, prompt: str, contents: list[str]) -> list[int]:
        """Token ids of a rendered chat prompt whose messages' contents, in order, are `contents`."""
        if self.mode == "allow" or self.pattern is None:
            return self.tokenizer.encode(prompt)
        cuts, cursor = [], 0
        for content in contents:
            if not self.pattern.search(content):
                continue
            text, at = content, prompt.find(content, cursor)
            if at < 0:  # a template may trim what it renders
                text = content.strip()
                at = prompt.find(text, cursor)
            if at < 0:
                raise InvalidRequestError(
                    "a message holds special-token text that the chat template changes, so "
                    "it cannot be escaped (--special-tokens-in-content escape)",
                    "messages",
                )
            cuts += [at + m.start() + 1 for m in self.pattern.finditer(text)]
            cursor = at + len(text)
        if not cuts:
            return self.tokenizer.encode(prompt)
        ids, start = [], 0
        for cut in [*cuts, len(prompt)]:
            ids += self.tokenizer.encode(prompt[start:cut])
            start = cut
        return ids
