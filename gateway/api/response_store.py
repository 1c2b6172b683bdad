"""The responses the Responses API keeps (`store`, the default) for `previous_response_id` and GET /v1/responses/{id}:
each with the conversation so far as chat messages, visible only to the API key that made it.

Each is kept encoded, so what it holds in memory is what is counted: the response as sent (instructions, tools and
metadata included) and the conversation. Each key's least recently used go past its own bounds; past the bounds of
all keys together, the key holding the most gives way, so a key within its share of the store loses nothing to
another's traffic, and the store's memory is bounded however many keys there are.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from gateway.api.protocol import ChatMessage

KEY_RESPONSES = 4096  # kept responses of one API key
KEY_BYTES = 64 * 1024 * 1024  # their encoded bytes
MAX_RESPONSES = 4 * KEY_RESPONSES  # of all keys together
MAX_BYTES = 4 * KEY_BYTES
ENTRY_BYTES = 256  # what a kept response costs besides its encoded bytes: its objects and dict entries

_encode = msgspec.json.Encoder().encode
_decode_messages = msgspec.json.Decoder(list[ChatMessage]).decode


@dataclass
class StoredResponse:
    body: bytes  # the ResponseObject as it was sent
    conversation: bytes  # the conversation through this response's output, instructions left out
    size: int  # what it counts against the bounds

    @property
    def messages(self) -> list[ChatMessage]:
        return _decode_messages(self.conversation)


@dataclass
class _Tenant:
    """One API key's kept responses, least recently used first."""

    items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    def __init__(
        self,
        key_responses: int = KEY_RESPONSES,
        key_bytes: int = KEY_BYTES,
        max_responses: int = MAX_RESPONSES,
        max_bytes: int = MAX_BYTES,
    ):
        self.key_responses, self.key_bytes = key_responses, key_bytes
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._tenants: dict[bytes, _Tenant] = {}  # by owner: the API key's salt (b"" without keys)
        self.count = self.bytes = 0  # of all keys together

    def put(self, response_id: str, owner: bytes, messages: list[ChatMessage], response: object) -> None:
        body, conversation = _encode(response), _encode(messages)
        item = StoredResponse(body, conversation, len(body) + len(conversation) + len(response_id) + ENTRY_BYTES)
        self._drop(owner, response_id)
        tenant = self._tenants.setdefault(owner, _Tenant())
        tenant.items[response_id] = item
        tenant.size += item.size
        self.count, self.bytes = self.count + 1, self.bytes + item.size
        while tenant.items and (len(tenant.items) > self.key_responses or tenant.size > self.key_bytes):
            self._drop(owner, next(iter(tenant.items)))
        while self.count > self.max_responses:
            self._drop_oldest(max(self._tenants, key=lambda o: len(self._tenants[o].items)))
        while self.bytes > self.max_bytes:
            self._drop_oldest(max(self._tenants, key=lambda o: self._tenants[o].size))

    def get(self, response_id: str, owner: bytes) -> StoredResponse | None:
        tenant = self._tenants.get(owner)
        item = tenant.items.get(response_id) if tenant is not None else None
        if item is not None:
            tenant.items.move_to_end(response_id)
        return item

    def delete(self, response_id: str, owner: bytes) -> bool:
        return self._drop(owner, response_id)

    def _drop_oldest(self, owner: bytes) -> None:
        self._drop(owner, next(iter(self._tenants[owner].items)))

    def _drop(self, owner: bytes, response_id: str) -> bool:
        tenant = self._tenants.get(owner)
        item = tenant.items.pop(response_id, None) if tenant is not None else None
        if item is None:
            return False
        tenant.size -= item.size
        self.count, self.bytes = self.count - 1, self.bytes - item.size
        if not tenant.items:
            del self._tenants[owner]
        return True
