"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, mapped to HTTP in one place."""

from __future__ import annotations

import logging
import math

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from engine.core.sampling_params import InvalidRequestError

log = logging.getLogger("orcinus.gateway")


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error body, HTTP or SSE: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class APIError(Exception):
    """An error the client sees: HTTP `status` plus OpenAI's four error fields (and extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})


def _retry_headers(retry_after: float | None) -> dict[str, str]:
    return {} if retry_after is None else {"Retry-After": str(max(0, math.ceil(retry_after)))}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def authentication_error(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, "authentication_error", code="invalid_api_key")


def host_not_allowed() -> APIError:
    return APIError(
        403,
        "The Host header names a host this server does not answer to (see --allowed-hosts).",
        "invalid_request_error",
        code="host_not_allowed",
    )


def unsupported_media_type() -> APIError:
    return APIError(
        415,
        "The request body must be JSON, sent with `Content-Type: application/json`.",
        "invalid_request_error",
        code="unsupported_media_type",
    )


def model_not_found(model: str) -> APIError:
    return not_found(f"The model `{model}` does not exist.", "model")


def not_found(message: str, param: str | None) -> APIError:
    """The engine's word that a request names a model it does not serve."""
    return APIError(404, message, "not_found_error", param, "model_not_found")


def lora_not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name")


def route_not_found(method: str, path: str) -> APIError:
    return APIError(404, f"Unknown route: {method} {path}", "not_found_error")


def request_too_large(limit: int) -> APIError:
    return APIError(
        413, f"Request body is larger than {limit} bytes.", "invalid_request_error", code="request_too_large"
    )


def request_timeout(seconds: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {seconds:g} seconds.",
        "invalid_request_error",
        code="request_timeout",
    )


def rate_limited(message: str = "Too many requests; retry later.", retry_after: float = 1.0) -> APIError:
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded", headers=_retry_headers(retry_after))


def service_unavailable(message: str = "The engine is unavailable.", retry_after: float | None = None) -> APIError:
    return APIError(
        503, message, "service_unavailable_error", code="service_unavailable", headers=_retry_headers(retry_after)
    )


def internal_error(message: str = "The server had an internal error.") -> APIError:
    return APIError(500, message, "server_error", code="internal_error")


def from_invalid_request(e: InvalidRequestError) -> APIError:
    return invalid_request(str(e), e.param)


def error_body(exc: APIError | InvalidRequestError) -> bytes:
    """The JSON body; all four keys are always present (null when absent)."""
    if isinstance(exc, InvalidRequestError):
        exc = from_invalid_request(exc)
    return msgspec.json.encode(
        ErrorResponse(error=ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    )


def error_response(exc: APIError | InvalidRequestError) -> Response:
    status, headers = (400, {}) if isinstance(exc, InvalidRequestError) else (exc.status, exc.headers)
    return Response(error_body(exc), status_code=status, headers=headers, media_type="application/json")


async def handle_api_error(request: Request, exc: APIError | InvalidRequestError) -> Response:
    return error_response(exc)


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405 (and any other HTTPException) in OpenAI's shape."""
    if exc.status_code == 404:
        err = route_not_found(request.method, request.url.path)
    elif exc.status_code == 405:
        err = APIError(
            405,
            f"Method {request.method} is not allowed for {request.url.path}",
            "invalid_request_error",
            code="method_not_allowed",
            headers=exc.headers,
        )
    else:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
    return error_response(err)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(internal_error())


# Pass as Starlette(exception_handlers=EXCEPTION_HANDLERS).
EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    InvalidRequestError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
