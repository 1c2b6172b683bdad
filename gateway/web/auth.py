"""API keys: `Authorization: Bearer <key>` on every /v1 route (and /metrics), each key compared in constant time;
and the prefix-cache salt each request gets from its key and its `cache_salt`."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from gateway.web import errors

TENANT = "orcinus.tenant"  # scope["state"] key: the matched API key (bytes), None without keys


def read_keys_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def check_key(key: str) -> str:
    """A key travels in a header: printable ASCII without spaces."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("an API key must be printable ASCII without spaces")
    return key


_TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, outside /v1: they need the key too


class APIKeyMiddleware:
    """Pure ASGI, so streams pass through untouched. /health, /openapi.json and the chat page stay open.

    Every key is compared, whatever matched first, so the time taken says nothing about which key (or how much
    of one) a guess got right. The matched key goes into the request's state for the cache salt."""

    def __init__(self, app, api_keys: tuple[str, ...], protect_metrics: bool = True):
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or path in _TOKENIZER_ROUTES or (self.protect_metrics and path == "/metrics")

    def match(self, given: bytes) -> bytes | None:
        found = None
        for expected in self.expected:
            if hmac.compare_digest(given, expected):
                found = expected
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            key = self.match(given)
            if key is None and self._protected(scope["path"]):
                await errors.error_response(errors.authentication_error())(scope, receive, send)
                return
            scope.setdefault("state", {})[TENANT] = key
        await self.app(scope, receive, send)


class CacheSalts:
    """The opaque salt the engine mixes into a request's first block name (engine/core/kv_cache.py).

    Scope `key`: each API key's requests share cached prefixes only among themselves, so one key cannot learn
    from timings or /metrics what another's prompts were (vLLM's CVE-2025-46570), nor from the tokens a step drafts
    what another's answers were (engine/drafting/pools.py). `global`: keys share the cache and the drafts' outputs.
    A request's `cache_salt` (vLLM's field) splits its key's cache further. The salt is an HMAC under a secret
    made at startup: the engine never sees a key, and the salt of a known key and salt cannot be computed.
    """

    def __init__(self, scope: str = "key"):
        self.scope = scope
        self._secret = secrets.token_bytes(32)

    def salt(self, tenant: bytes | None, cache_salt: str | None) -> bytes:
        """b"" (no salt: the cache every unsalted request shares) when neither a key's scope nor a salt applies."""
        tenant = tenant if self.scope == "key" else None
        if tenant is None and cache_salt is None:
            return b""
        tenant = tenant or b""
        message = len(tenant).to_bytes(4, "little") + tenant + (cache_salt or "").encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()
