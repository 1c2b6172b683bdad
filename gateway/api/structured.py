"""JSON schemas (`response_format`, tools) -> the llguidance grammars the engine constrains decoding with.

Compiling a large schema takes a while (a 0.4 MB one about half a second), so the handlers do it in a pool of
threads (`SchemaCompiler`; llguidance drops the GIL while it works): the request waits, the event loop serves
everyone else. A schema past MAX_SCHEMA_BYTES or MAX_JSON_DEPTH, or one that does not compile, is a 400.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance
import msgspec

from engine.core.sampling_params import InvalidRequestError
from engine.ipc.grammar_gate import background_thread

# Compact JSON with single spaces: a flexible-whitespace grammar lets a small model emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
MAX_SCHEMA_BYTES = 512 * 1024  # one schema's JSON; OpenAI's strict schemas are far smaller
MAX_GRAMMAR_BYTES = 2 * 1024 * 1024  # a request's grammar, which the engine's 4 MiB inbound ring must carry
MAX_JSON_DEPTH = 64  # nested arrays and objects in a schema or a call's arguments (json.dumps and jinja recurse)
COMPILE_THREADS = 2
CACHE_BYTES = 32 * 1024 * 1024  # schemas and grammars kept: clients resend the same schemas


def json_depth(value: object) -> int:
    """How deep arrays and objects nest in `value` (0 for a scalar), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_depth(value: object, param: str, what: str) -> None:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"{what} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels", param)


# Keywords whose value is a schema or a list of schemas, and those whose value maps names to schemas.
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "anyOf",
    "oneOf",
    "allOf",
    "additionalItems",
    "propertyNames",
    "unevaluatedItems",
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: dict, param: str) -> dict:
    """OpenAI's strict mode: a copy of `schema` in which every object schema that leaves `additionalProperties`
    unset forbids undeclared keys (a small model otherwise invents keys until max_tokens); `param`: its field."""
    check_depth(schema, param, "the JSON schema")
    out = msgspec.json.decode(msgspec.json.encode(schema))
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if (
            kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
        ) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for k in _SUBSCHEMAS:
            value = node.get(k)
            stack.extend(value if isinstance(value, list) else [value])
        for k in _MAPS:
            if isinstance(node.get(k), dict):
                stack.extend(node[k].values())
    return out


def schema_text(schema: dict, param: str) -> str:
    """The schema as JSON text; InvalidRequestError if it nests too deep or is too large."""
    check_depth(schema, param, "the JSON schema")
    text = msgspec.json.encode(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"the JSON schema is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are accepted", param
        )
    return text


def compile_schema(text: str) -> tuple[str, str | None]:
    """(grammar, None), or ("", why the schema cannot be one). Blocking: call it in a thread."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except Exception as e:
        return "", f"invalid JSON schema: {e}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        return "", f"unsupported JSON schema: {error}"
    if len(grammar) > MAX_GRAMMAR_BYTES:
        return "", f"the schema's grammar is {len(grammar)} bytes; at most {MAX_GRAMMAR_BYTES} are accepted"
    return grammar, None


def json_schema_grammar(schema: dict, param: str = "response_format") -> str:
    """The grammar of JSON documents matching `schema`, compiled here and now (offline use, tests)."""
    grammar, error = compile_schema(schema_text(schema, param))
    if error:
        raise InvalidRequestError(error, param)
    return grammar


class SchemaCompiler:
    """Compiles schemas in a thread pool. A schema compiled before is answered from a cache (LRU, bounded in
    bytes); one compiling now is waited for, not compiled twice."""

    def __init__(self, threads: int = COMPILE_THREADS, cache_bytes: int = CACHE_BYTES):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="schema", initializer=background_thread)
        self._cache_bytes = cache_bytes
        self._done: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # schema text -> compile_schema()
        self._held = 0  # bytes of keys and grammars in _done
        self._compiling: dict[str, asyncio.Future] = {}
        self.compiled = 0  # schemas compiled (not found in the cache), for tests

    async def grammar(self, schema: dict, param: str) -> str:
        """The schema's grammar; InvalidRequestError naming `param` if it cannot be one."""
        text = schema_text(schema, param)
        result = self._done.get(text)
        if result is not None:
            self._done.move_to_end(text)
        else:
            future = self._compiling.get(text)
            if future is None:
                future = asyncio.get_running_loop().run_in_executor(self._pool, compile_schema, text)
                self._compiling[text] = future
                future.add_done_callback(lambda f: self._keep(text, f))
                self.compiled += 1
            result = await asyncio.shield(future)  # a client that leaves does not cancel the others' compile
        grammar, error = result
        if error:
            raise InvalidRequestError(error, param)
        return grammar

    def _keep(self, text: str, future: asyncio.Future) -> None:
        self._compiling.pop(text, None)
        if future.cancelled() or future.exception() is not None:
            return
        grammar, _ = self._done[text] = future.result()
        self._held += len(text) + len(grammar)
        while self._held > self._cache_bytes and self._done:
            old, (old_grammar, _) = self._done.popitem(last=False)
            self._held -= len(old) + len(old_grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
