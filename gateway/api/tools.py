"""Tool calling for chat completions: tools described to the model, calls constrained or recognised, parsed.

A chat template that renders tools itself gets them (as transformers passes them); for one that does not,
a generic system message describes them and asks for a call as one JSON object `{"name": ..., "arguments":
{...}}`. With `tool_choice` `required` or a named function that object is enforced by a grammar built
from the functions' parameter schemas (one call); with `auto` the model may answer in text or with such objects,
and an answer that parses as calls of known functions becomes them (several with `parallel_tool_calls`, the
default). Streamed, gateway/api/tool_stream.py sends them as they are generated.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from msgspec import Struct

from engine.core.sampling_params import InvalidRequestError
from gateway.api.structured import check_depth, strict_schema

SYSTEM_PROMPT = (
    "You can call these functions:\n{tools}\n"
    "To call one, reply with only a JSON object of the form "
    '{{"name": "<function name>", "arguments": {{<the arguments>}}}} and nothing else. '
    "{choice}"
)
TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
CHOICE_TEXT = {"auto": "If no function helps, answer normally.", "required": "You must call a function."}


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # OpenAI's strict mode: undeclared argument keys are forbidden


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _parameters(f: FunctionDef) -> dict:
    if not f.parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return strict_schema(f.parameters, "tools") if f.strict else f.parameters


def _call_schema(f: FunctionDef) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "arguments"],
        "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
    }


class ToolPlan:
    """What one request's tools and tool_choice mean: the system message, the grammar, how to read the answer."""

    def __init__(self, tools: list[Tool], choice: ToolChoice | None):
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("function names in tools must be unique", "tools")
        self.functions = {t.function.name: t.function for t in tools}
        self.mode = "auto" if choice is None else choice if isinstance(choice, str) else "named"
        if self.mode == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
        offered = list(self.functions.values())
        if self.mode == "named":
            if choice.function.name not in self.functions:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
                )
            offered = [self.functions[choice.function.name]]
        self.checked = offered  # every one's schema must compile (gateway/api/serving.py), or the request is a 400
        self.offered = offered if self.mode != "none" else []

    @property
    def active(self) -> bool:
        return bool(self.offered)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def system_message(self) -> dict[str, str]:
        listing = json.dumps(
            [{"name": f.name, "description": f.description or "", "parameters": _parameters(f)} for f in self.offered]
        )
        choice = CHOICE_TEXT.get(self.mode, f"You must call {self.offered[0].name}.")
        return {"role": "system", "content": SYSTEM_PROMPT.format(tools=listing, choice=choice)}

    def template_tools(self) -> list[dict]:
        """The offered tools as chat templates take them (OpenAI's shape, as transformers passes them)."""
        return [
            {
                "type": "function",
                "function": {"name": f.name, "description": f.description or "", "parameters": _parameters(f)},
            }
            for f in self.offered
        ]

    def schemas(self) -> list[dict]:
        """The parameter schemas that must compile."""
        return [_parameters(f) for f in self.checked]

    def call_schema(self) -> dict | None:
        """With a call required, the answer must be one: a call object of one of the offered functions."""
        if not self.forced:
            return None
        schemas = [_call_schema(f) for f in self.offered]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    def parse_calls(self, text: str, parallel: bool = True) -> list[ToolCall]:
        """The calls `text` makes if it is nothing but calls of known functions: JSON objects one after another or in
        an array, each maybe in the <tool_call> tags Hermes/Qwen templates teach, its arguments under "arguments" (or
        Llama's "parameters"). Otherwise [] (it is plain content). Without `parallel`, the first call only."""
        if not self.active:
            return []
        values, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(text):
            if text[pos] in " \t\r\n,":
                pos += 1
            elif text.startswith(TAG_OPEN, pos) or text.startswith(TAG_CLOSE, pos):
                pos = text.index(">", pos) + 1
            else:
                try:
                    value, pos = decoder.raw_decode(text, pos)
                except (ValueError, RecursionError):  # the model's text nests past json's limit: no call
                    return []
                values.extend(value if isinstance(value, list) else [value])
        calls = []
        for obj in values:
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if not (isinstance(args, dict) and obj.get("name") in self.functions):
                return []
            calls.append(
                ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=obj["name"], arguments=json.dumps(args)),
                )
            )
        return calls if parallel else calls[:1]


def call_arguments(call: ToolCall, param: str) -> Any:
    """A past call's arguments, decoded; InvalidRequestError naming `param` if they are not JSON (or nest too deep)."""
    try:
        value = json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):
        raise InvalidRequestError("a tool call's arguments must be JSON text", param) from None
    check_depth(value, param, "a tool call's arguments")
    return value


def history_message(role: str, content: str, tool_calls: list[ToolCall] | None, tool_call_id: str | None) -> dict:
    """A past message for the chat template: an assistant's calls in the form the model is asked to answer in,
    a tool's result as a `tool` message (which the template renders as it renders any role). The calls' arguments
    were checked by ChatCompletionRequest.validate()."""
    if tool_calls:
        calls = [{"name": c.function.name, "arguments": call_arguments(c, "tool_calls")} for c in tool_calls]
        content = (content + "\n" if content else "") + "\n".join(json.dumps(c) for c in calls)
    if role == "tool" and tool_call_id:
        content = f"(result of {tool_call_id}) {content}"
    return {"role": role, "content": content}
