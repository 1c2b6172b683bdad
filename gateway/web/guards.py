"""Browser-facing guards: the Host allowlist (DNS rebinding), JSON-only POST bodies (cross-site form posts), and
the chat page's Content-Security-Policy."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re

from gateway.web import errors

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(bind_host: str) -> bool:
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """A server bound to loopback answers only to loopback names (as Ollama, after CVE-2024-28224): a page on
    another site whose name was rebound to 127.0.0.1 sends its own name as Host. Elsewhere: any Host."""
    if not is_loopback(bind_host):
        return None
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, *_url_hosts(bind_host))))


def _url_hosts(bind_host: str) -> tuple[str, ...]:
    """The bound address as a URL's host names it (127.0.0.2, [::1]): the only address the server listens on, and
    an address, unlike a name, cannot be rebound."""
    try:
        ip = ipaddress.ip_address(bind_host.strip("[]"))
    except ValueError:
        return ()
    if ip.version == 4:
        return (str(ip),)
    return (f"[{bind_host.strip('[]').lower()}]", f"[{ip.compressed}]")


def _host_name(header: bytes) -> str:
    """`Host` without its port, lower-cased: "[::1]:8000" -> "[::1]", "Example.com:80" -> "example.com"."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class TrustedHostMiddleware:
    """Refuses (403, OpenAI's error shape) a request whose Host is not allowed: names, `*.example.com`, or `*`."""

    def __init__(self, app, allowed_hosts: tuple[str, ...]):
        self.app = app
        self.any = "*" in allowed_hosts
        self.exact = {h.lower() for h in allowed_hosts if not h.startswith("*")}
        self.suffixes = tuple(h[1:].lower() for h in allowed_hosts if h.startswith("*."))

    def allowed(self, host: str) -> bool:
        return self.any or host in self.exact or (host != "" and host.endswith(self.suffixes))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.allowed(_host_name(dict(scope["headers"]).get(b"host", b""))):
            await errors.error_response(errors.host_not_allowed())(scope, receive, send)
            return
        await self.app(scope, receive, send)


def is_json(content_type: str | None) -> bool:
    """`application/json`, parameters (charset) allowed: the one body type a cross-site form cannot send without a
    CORS preflight."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def page_headers(page: str) -> dict[str, str]:
    """Headers of the chat page: it runs only its own inline script and style (by hash), talks only to this server,
    and no other site may frame it or have its type sniffed."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    policy = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
