"""The Responses API's request, response and stream-event structs (POST /v1/responses), and how a request becomes the
chat request it runs as: `instructions` a system message, input items messages, function tools chat tools,
`text.format` a response_format, `max_output_tokens` max_completion_tokens."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from engine.core.sampling_params import InvalidRequestError
from gateway.api.protocol import (
    MAX_CACHE_SALT,
    MIN_FACTOR,
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    MaxTokens,
    ResponseFormat,
)
from gateway.api.tools import FunctionCall, FunctionDef, FunctionName, NamedToolChoice, Tool, ToolCall

TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]], Meta(max_length=16)
]


class InputContent(Struct, kw_only=True):
    type: str  # input_text, or output_text in an earlier assistant message
    text: str | None = None


class InputItem(Struct, kw_only=True):
    """A message (`type` "message" or absent), a function call the model made, or a call's output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self, param: str) -> str:
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content or ()):
            if part.type not in TEXT_PARTS:
                raise InvalidRequestError(
                    f"content type {part.type!r} is not supported; only text", f"{param}.content[{j}].type"
                )
            if part.text is None:
                raise InvalidRequestError("a text content part needs `text`", f"{param}.content[{j}].text")
        return "\n".join(part.text for part in self.content or ())


class FunctionTool(Struct, kw_only=True):
    type: Literal["function"]  # the built-in tools (web search, files, computer use) are OpenAI's own
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat = field(default_factory=TextFormat)


class Reasoning(Struct, kw_only=True):
    effort: str | None = None  # accepted and ignored: the served models do not reason apart from their answer
    summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    """POST /v1/responses. Unknown fields are ignored."""

    input: str | Annotated[list[InputItem], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=MIN_FACTOR, le=1.0)] | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    # vLLM's, as on chat: only responses with the same salt (and API key) share cached prompt prefixes
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None

    def input_messages(self) -> list[ChatMessage]:
        """The input items as chat messages: consecutive function calls join one assistant message."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        out: list[ChatMessage] = []
        for i, item in enumerate(self.input):
            param = f"input[{i}]"
            if item.type == "message":
                if item.role is None or item.content is None:
                    raise InvalidRequestError("a message item needs `role` and `content`", param)
                out.append(ChatMessage(role=item.role, content=item.text(param)))
            elif item.type == "function_call":
                if not (item.call_id and item.name and item.arguments is not None):
                    raise InvalidRequestError("a function_call item needs `call_id`, `name` and `arguments`", param)
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                if out and out[-1].role == "assistant" and out[-1].tool_calls:
                    out[-1].tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                if not item.call_id or item.output is None:
                    raise InvalidRequestError("a function_call_output item needs `call_id` and `output`", param)
                out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return out

    def to_chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this runs as, after the earlier turns `history` (instructions are not carried over)."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        tools = [
            Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in self.tools or ()
        ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice(function=FunctionName(name=choice.name))
        chat = ChatCompletionRequest(
            model=self.model,
            messages=system + history + self.input_messages(),
            stream=self.stream,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            user=self.user,
            cache_salt=self.cache_salt,
        )
        try:
            chat.validate()
        except InvalidRequestError as e:
            raise renamed(e) from None
        return chat

    def _response_format(self) -> ResponseFormat | None:
        f = (self.text or TextConfig()).format
        if f.type != "json_schema":
            return ResponseFormat(type=f.type)
        if f.name is None or f.schema is None:
            raise InvalidRequestError("a json_schema text format needs `name` and `schema`", "text.format")
        return ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(name=f.name, schema=f.schema, description=f.description, strict=f.strict),
        )

    def validate(self) -> None:
        self.input_messages()


_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def renamed(e: InvalidRequestError) -> InvalidRequestError:
    """An error of the chat request a response runs as, naming this API's fields."""
    return InvalidRequestError(
        str(e).replace("max_completion_tokens", "max_output_tokens"), _RENAMED.get(e.param, e.param)
    )


# --- what the server sends ---


class OutputText(Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # OpenAI's explicit prompt caching, which this server does not bill


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseError(Struct, kw_only=True):
    """Why a response failed (status "failed"); `code` is one of OpenAI's for a response's error."""

    code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]
    message: str


class ResponseObject(Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage | FunctionCallItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = field(default_factory=TextConfig)
    reasoning: Reasoning = field(default_factory=Reasoning)
    store: bool = True
    metadata: dict[str, str] = {}
    truncation: Literal["disabled"] = "disabled"


# Stream events: each a `data:` line under an `event:` line of its `type`, numbered in order.
class ResponseEvent(Struct, kw_only=True):
    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
    ]
    sequence_number: int
    response: ResponseObject


class ErrorEvent(Struct, kw_only=True):
    """A failure after the stream started; `response.failed` follows it."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None
    message: str
    param: str | None


class OutputItemEvent(Struct, kw_only=True):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputMessage | FunctionCallItem


class _ItemEvent(Struct, kw_only=True):
    """What every event about one output item carries: its place in the stream and the item's."""

    sequence_number: int
    item_id: str
    output_index: int


class ContentPartEvent(_ItemEvent, kw_only=True):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(_ItemEvent, kw_only=True):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(_ItemEvent, kw_only=True):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ArgumentsDeltaEvent(_ItemEvent, kw_only=True):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(_ItemEvent, kw_only=True):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


StreamEvent = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
