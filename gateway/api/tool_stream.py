"""A streamed choice read as it is generated: plain content, or tool calls in OpenAI's delta shape.

A call goes out as soon as its function's name is known (id, type and name, arguments ""), then its arguments as
the model writes them, a fragment per event; with `parallel_tool_calls` the calls that follow get the next
indices. The text is held while it could still be a call (all of it when a call is required; with `auto`, from a
first non-blank `{`, `[` or `<tool_call>`). A stream commits to a call once a known name opens it; an answer that
turns out to hold no such opening is sent as content at the end, or, if it parses as calls anyway (arguments
written before the name, say), as whole calls.
"""

from __future__ import annotations

import re
import uuid

from gateway.api.protocol import FunctionCallDelta, ToolCallChunk
from gateway.api.tools import TAG_CLOSE, TAG_OPEN, ToolCall, ToolPlan

_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
# The first call: an array's `[` or a template's tag may come first. A later one: the previous call's closing `}`
# (and tag), then a comma or a new tag.
_FIRST = re.compile(r"\s*(?:\[\s*)?(?:" + re.escape(TAG_OPEN) + r"\s*)?" + _NAME)
_NEXT = re.compile(r"\s*\}\s*(?:" + re.escape(TAG_CLOSE) + r"\s*)?,?\s*(?:" + re.escape(TAG_OPEN) + r"\s*)?" + _NAME)
_OPENINGS = ("{", "[", TAG_OPEN)


class ToolCallStream:
    """Feed it each event's text; it says what to send: content, and deltas of calls."""

    def __init__(self, plan: ToolPlan, parallel: bool):
        self.plan, self.parallel = plan, parallel
        self.text = ""
        self.pos = 0  # how far the text has been read as calls
        self.content = False  # decided: plain text, sent as it comes
        self.calls: list[str] = []  # ids of the calls sent so far
        self.depth = 0  # inside the current call's arguments: open brackets, and whether in a string
        self.in_string = self.escaped = False

    def feed(self, text: str) -> tuple[str, list[ToolCallChunk]]:
        """(content to send, call deltas to send) for an event's new text."""
        self.text += text
        if self.content:
            return text, []
        if not self.calls:
            start = self.text.lstrip()
            if not self.plan.forced and start and not any(o.startswith(start[: len(o)]) for o in _OPENINGS):
                self.content = True
                return self.text, []
            return "", self._open(_FIRST)
        return "", self._read()

    def finish(self, stopped: bool) -> tuple[str, list[ToolCallChunk], bool]:
        """At the choice's end: (content, call deltas, whether it made calls). Held text that opened no call is
        content, unless it parses as calls of known functions after all (and the model stopped by itself)."""
        if self.content or self.calls:
            return "", [], bool(self.calls)
        calls = self.plan.parse_calls(self.text, self.parallel) if stopped else []
        if not calls:
            return self.text, [], False
        return "", [whole_call(c, i) for i, c in enumerate(calls)], True

    def _open(self, pattern: re.Pattern) -> list[ToolCallChunk]:
        m = pattern.match(self.text, self.pos)
        if m is None or m.group(1) not in self.plan.functions:
            return []
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append(call_id)
        self.pos, self.depth = m.end(), 0
        head = ToolCallChunk(
            index=len(self.calls) - 1,
            id=call_id,
            type="function",
            function=FunctionCallDelta(name=m.group(1), arguments=""),
        )
        return [head, *self._read()]

    def _read(self) -> list[ToolCallChunk]:
        """The current call's new argument text, up to and with the bracket that closes it; then the next call."""
        if self.depth < 0:  # the last call's arguments are whole: another call may follow
            return self._open(_NEXT) if self.parallel else []
        start = self.pos
        for i in range(self.pos, len(self.text)):
            c = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos, self.depth = i + 1, -1
                    piece = [self._args(self.text[start : self.pos])]
                    return piece + (self._open(_NEXT) if self.parallel else [])
        self.pos = len(self.text)
        return [self._args(self.text[start:])] if self.pos > start else []

    def _args(self, fragment: str) -> ToolCallChunk:
        return ToolCallChunk(index=len(self.calls) - 1, function=FunctionCallDelta(arguments=fragment))


def whole_call(call: ToolCall, index: int) -> ToolCallChunk:
    """A call in one delta: its id, name and all its arguments."""
    return ToolCallChunk(
        index=index,
        id=call.id,
        type="function",
        function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments),
    )
