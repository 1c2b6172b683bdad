"""`response_format` -> the llguidance grammar the engine constrains decoding with; a bad schema is a 400."""

from __future__ import annotations

import functools

import llguidance
import msgspec

from engine.core.sampling_params import InvalidRequestError

# Compact JSON with single spaces: a flexible-whitespace grammar lets a small model emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


def json_schema_grammar(schema: dict, param: str = "response_format") -> str:
    """The grammar of JSON documents matching `schema`; InvalidRequestError naming `param` if it cannot be one."""
    grammar, error = _compile(msgspec.json.encode(schema).decode())
    if error:
        raise InvalidRequestError(error, param)
    return grammar


# Validation and the handler both need a request's grammars, and clients resend the same schemas: compile once.
@functools.lru_cache(maxsize=256)
def _compile(schema: str) -> tuple[str, str | None]:
    """(grammar, None), or ("", why the schema cannot be one)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except Exception as e:  # noqa: BLE001 - whatever a client's schema makes the compiler raise is a 400
        return "", f"invalid JSON schema: {e}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return (grammar, None) if not error else ("", f"unsupported JSON schema: {error}")
