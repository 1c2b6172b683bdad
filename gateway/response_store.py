"""The responses the Responses API keeps (`store`, the default) for `previous_response_id` and GET /v1/responses/{id}:
each with the conversation so far as chat messages, visible only to the API key that made it, the oldest dropped
past a bound on count and characters."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.protocol import ChatMessage

MAX_RESPONSES = 4096  # kept responses
MAX_CHARS = 64 * 1024 * 1024  # characters of their conversations, all together


@dataclass
class StoredResponse:
    owner: bytes  # who may read it: the API key's salt
    messages: list[ChatMessage]  # the conversation through this response's output, instructions left out
    response: object  # the ResponseObject as it was sent
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, response_id: str, owner: bytes, messages: list[ChatMessage], response: object) -> None:
        chars = sum(len(m.text) + sum(len(c.function.arguments) for c in m.tool_calls or ()) for m in messages)
        self._items[response_id] = StoredResponse(owner, messages, response, chars)
        self._chars += chars
        while self._items and (len(self._items) > self.max_responses or self._chars > self.max_chars):
            _, dropped = self._items.popitem(last=False)
            self._chars -= dropped.chars

    def get(self, response_id: str, owner: bytes) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is None or item.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str, owner: bytes) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._chars -= self._items.pop(response_id).chars
        return True
