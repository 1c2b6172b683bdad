"""CORS: which browser origins may call the API. By default pages served from this machine
(`http://localhost:*`, `http://127.0.0.1:*`), as Ollama does; `--allowed-origins` names others."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

LOCAL_ORIGINS = r"^http://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$"  # any port on this machine, http only


def add_cors(app: Starlette, allowed_origins: tuple[str, ...] | None) -> None:
    """Let pages on `allowed_origins` call the API: None = this machine's; otherwise exactly these ("*": any).

    Add it after the API key check, so that it is outside it: preflights are answered before the key is checked,
    and errors (401, 429) carry CORS headers, so a page can read them. Only the Host check is further out.
    """
    if allowed_origins is None:
        origins = {"allow_origin_regex": LOCAL_ORIGINS}
    else:
        origins = {"allow_origins": list(allowed_origins)}
    # Any request header (as vLLM): the origin is the boundary, and the API key is still checked on every request.
    # The OpenAI JS SDK sends its own (X-Stainless-*) on every call, so a short list fails its preflight.
    app.add_middleware(
        CORSMiddleware,
        **origins,
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],  # DELETE: /v1/responses/{id}
        allow_headers=["*"],
        expose_headers=["Retry-After"],
        max_age=600,
    )
