"""The API key: `Authorization: Bearer <key>` on every /v1 route (and /metrics when asked), compared in constant time."""

from __future__ import annotations

import hmac

from gateway import errors


class APIKeyMiddleware:
    """Pure ASGI, so streams pass through untouched. /health and /openapi.json stay open."""

    def __init__(self, app, api_key: str, protect_metrics: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._protected(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await errors.error_response(errors.authentication_error())(scope, receive, send)
                return
        await self.app(scope, receive, send)
