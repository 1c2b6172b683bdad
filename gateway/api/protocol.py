"""OpenAI API request/response structs; msgspec decodes and type-checks, `validate()` does the rest."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from engine.core.request import RequestOptions
from engine.core.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from gateway.api.structured import ANY_OBJECT, strict_schema
from gateway.api.tools import Tool, ToolCall, ToolChoice, ToolPlan, call_arguments, history_message
from gateway.web.errors import request_too_large

MAX_N = 16  # choices per prompt (`n`)
# Stop strings per request (OpenAI allows 4; vLLM and llama.cpp any number). Each token costs the detokenizer a
# search per string over its last MAX_STOP_LEN characters: both bounds keep that small beside a decode step.
MAX_STOP = 64
MAX_STOP_LEN = 256  # characters per stop string
MAX_PROMPTS = 64  # prompts in one completions request
MAX_BODY_BYTES = 4 * 1024 * 1024  # request body size; larger is a 413
MAX_DRAIN_BYTES = 256 * 1024 * 1024  # of a refused body, read and dropped so that the client sees its 413
BODY_TIMEOUT = 60.0  # seconds a whole body may take to arrive (4 MiB at 70 KB/s); then a 408
MAX_CACHE_SALT = 1024  # characters of `cache_salt`
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS  # completions `logprobs` (OpenAI's legacy API took 5; vLLM 20)
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # chat `top_logprobs` (20, the engine's limit)
# The engine samples in float32 (bf16 on a GPU): a tinier positive top_p or repetition penalty rounds
# to 0 or overflows `logit / factor` to inf, and the sampler fails on the NaNs.
MIN_FACTOR = 1e-6
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (as vLLM); dividing by it would overflow likewise

TokenId = Annotated[int, Meta(ge=0)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # what msgspec can send to the engine
Seed = Int64  # int64, what torch.Generator takes
# The ranges SamplingParams enforces, stated on the fields too so that /openapi.json shows them.
TopK = Annotated[int, Meta(ge=-1, le=2**63 - 1)]  # k >= vocab means all; larger than int64 cannot cross
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
Role = Literal["system", "user", "assistant", "tool", "developer"]
FinishReason = Literal["stop", "length", "tool_calls"]
_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(Struct, kw_only=True):
    """`text`, `json_object` (any JSON object) or `json_schema` (a document matching `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> dict | None:
        """The schema the output must match; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ANY_OBJECT
        if self.json_schema is None:
            raise InvalidRequestError("response_format type 'json_schema' needs `json_schema`", "response_format")
        schema = self.json_schema.schema or ANY_OBJECT
        return strict_schema(schema, "response_format") if self.json_schema.strict else schema


class _SamplingFields(Struct, kw_only=True):
    """Fields both endpoints share. Unknown fields (`user`, `metadata`, ...) are ignored."""

    model: str | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Meta(ge=MIN_FACTOR, le=1.0)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=MIN_FACTOR, le=2.0)] | None = None
    logit_bias: dict[str, Bias] | None = None  # OpenAI sends token ids as string keys
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    response_format: ResponseFormat | None = None  # constrain the output to JSON (a schema's, or any object)
    # vLLM's: only requests with the same salt (and API key) share cached prompt prefixes; make it random and secret
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's: under `--scheduling-policy priority` lower is admitted first; ignored under fcfs
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0

    def to_request_options(self, cache_salt: bytes, lora: str = "") -> RequestOptions:
        """What the engine takes besides the prompt and its sampling; `cache_salt`: the API key's and this field's;
        `lora`: the adapter its `model` names ("" for the base model)."""
        return RequestOptions(cache_salt, self.priority, lora)

    @property
    def stop_strings(self) -> list[str]:
        """Stop strings; the gateway matches them on detokenized text (they are not in SamplingParams)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def output_schema(self) -> tuple[dict, str] | None:
        """The schema whose grammar shapes the output, and the field it comes from; None: unconstrained."""
        schema = self.response_format.schema() if self.response_format is not None else None
        return None if schema is None else (schema, "response_format")

    def checked_schemas(self) -> list[tuple[dict, str]]:
        """Further schemas that must compile, though they do not shape the output."""
        return []

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None, grammar: str | None
    ) -> SamplingParams:
        given = {k: getattr(self, k) for k in _OPTIONAL_SAMPLING}
        if given["temperature"] is not None and given["temperature"] < GREEDY_BELOW:
            given["temperature"] = 0.0
        given["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
        return SamplingParams(  # a None keeps SamplingParams' default; SamplingParams checks the ranges
            **{k: v for k, v in given.items() if v is not None},
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            grammar=grammar,
        )

    def _validate_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        stops = self.stop_strings
        if len(stops) > MAX_STOP:
            raise InvalidRequestError(f"at most {MAX_STOP} stop strings are allowed", "stop")
        if any(not 0 < len(s) <= MAX_STOP_LEN for s in stops):
            raise InvalidRequestError(f"stop strings must be 1 to {MAX_STOP_LEN} characters long", "stop")
        self.output_schema()  # a json_schema format without its schema is a 400 here


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    # Past 19 digits no id can be valid (nor fit int64); past 4,300 int() itself would raise.
    bad = [k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 19)]
    if bad:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids (non-negative integers), got {bad[0][:40]!r}", "logit_bias"
        )
    return {int(k): v for k, v in bias.items()}


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    # str, list[str], list[int] or list[list[int]]
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]
    # null: up to the context window; 0 (with echo or prompt_logprobs): score the prompt, generate nothing
    max_tokens: Annotated[int, Meta(ge=0)] | None = 16
    # With echo, the prompt's tokens come first in `logprobs` too (the first one's logprob null), as OpenAI's did.
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    # vLLM's: each choice's `prompt_logprobs`, every prompt token's logprob and rank with this many top alternatives
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None  # only 1 is supported
    suffix: str | None = None  # not supported

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else list(p)

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: the engine computes the prompt (and samples one token, which is dropped)."""
        return self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many top alternatives each prompt token's logprobs need (vLLM: `prompt_logprobs`, else with echo the
        `logprobs`); None: the prompt's logprobs are not asked for."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs if self.echo and self.logprobs is not None else 0)
        return self.logprobs if self.echo else None

    def to_sampling_params(
        self, *, default_max_tokens: int | None = None, grammar: str | None = None
    ) -> SamplingParams:
        """`default_max_tokens` stands in for `max_tokens: null` (the gateway passes the room left in the
        context window); without it SamplingParams' default applies. `grammar`: output_schema()'s, compiled."""
        params = self._sampling(1 if self.prompt_only else self.max_tokens, self.logprobs, default_max_tokens, grammar)
        if self.prompt_only:  # a prompt that fills the context window can still be scored
            params = msgspec.structs.replace(params, prompt_only=True)
        prompt = self.num_prompt_logprobs
        return params if prompt is None else msgspec.structs.replace(params, prompt_logprobs=prompt)

    def validate(self) -> None:
        p = self.prompt
        if not isinstance(p, str):
            kinds = {type(x) for x in p}
            if len(kinds) > 1:
                raise InvalidRequestError(
                    "prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
                    "prompt",
                )
            if kinds != {int} and len(p) > MAX_PROMPTS:
                raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts are allowed per request", "prompt")
            if kinds == {list} and not all(p):
                raise InvalidRequestError("token id prompts must not be empty", "prompt")
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequestError("best_of is not supported (only 1)", "best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.prompt_only and not (self.echo or self.prompt_logprobs is not None):
            raise InvalidRequestError("max_tokens 0 returns nothing without echo or prompt_logprobs", "max_tokens")
        if self.prompt_only and self.min_tokens:
            raise InvalidRequestError("min_tokens must be between 0 and max_tokens", "min_tokens")
        self._validate_common()
        self.to_sampling_params(default_max_tokens=max(self.min_tokens, 1))


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # the newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # none | auto (the default) | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: a choice makes at most one call (None: several may come)

    def tool_plan(self) -> ToolPlan:
        return ToolPlan(self.tools or [], self.tool_choice)

    def template_messages(self, plan: ToolPlan | None = None) -> list[dict[str, str]]:
        """`[{"role", "content"}]` for the tokenizer's chat template, with the tools' system message first."""
        out = [history_message(m.role, m.text, m.tool_calls, m.tool_call_id) for m in self.messages]
        if plan is not None and plan.active:
            tools = plan.system_message()
            if out[0]["role"] == "system":  # one system message: many templates take no second one
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools["content"]}
            else:
                out.insert(0, tools)
        return out

    def output_schema(self) -> tuple[dict, str] | None:
        """A required call's schema (tools), else the response_format's."""
        call = self.tool_plan().call_schema() if self.tools else None
        own = super().output_schema()
        if call is not None and own is not None:
            raise InvalidRequestError(
                "a required tool call and a response_format cannot both shape the output", "tool_choice"
            )
        return (call, "tools") if call is not None else own

    def checked_schemas(self) -> list[tuple[dict, str]]:
        """Every offered function's parameters must compile, called or not."""
        return [(schema, "tools") for schema in self.tool_plan().schemas()] if self.tools else []

    def to_sampling_params(
        self, *, default_max_tokens: int | None = None, grammar: str | None = None
    ) -> SamplingParams:
        """As CompletionRequest.to_sampling_params; logprobs -> top_logprobs (0 when absent)."""
        explicit = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if explicit else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling(max_tokens, logprobs, default_max_tokens, grammar)
        except InvalidRequestError as e:
            if e.param == "max_tokens" and explicit:
                raise InvalidRequestError(
                    str(e).replace("max_tokens", "max_completion_tokens", 1), "max_completion_tokens"
                ) from None
            raise

    def validate(self) -> None:
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                raise InvalidRequestError("content is required", f"messages[{i}].content")
            for j, call in enumerate(m.tool_calls or ()):
                call_arguments(call, f"messages[{i}].tool_calls[{j}].function.arguments")
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":
                    raise InvalidRequestError(
                        f"content part type {part.type!r} is not supported; only 'text'",
                        f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise InvalidRequestError("a text content part needs `text`", f"messages[{i}].content[{j}].text")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        self._validate_common()
        self.to_sampling_params(default_max_tokens=max(self.min_tokens, 1))


# --- responses (encode with msgspec.json.encode) ---


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int  # of the prompt tokens, those found in the prefix cache (not computed again)


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        details = UNSET if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed first prompt token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct, kw_only=True):
    """vLLM's Logprob: one token at one prompt position."""

    logprob: float
    rank: int  # 1: the most likely token there
    decoded_token: str


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # With `prompt_logprobs` (vLLM's shape): per prompt token, null for the first, else {token id: PromptLogprob} for
    # the prompt's token and the top alternatives. In a stream, on each choice's first chunk.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Struct, kw_only=True):
    """A streamed completion event. `usage`: left UNSET it is omitted; with include_usage it is null on
    every chunk but the last, which has empty choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # present when the choice is a call


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    """Only the fields set appear: `{"role": "assistant", "content": ""}`, `{"content": "Hi"}`, `{}`."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class FunctionCallDelta(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None  # in a call's first delta only
    arguments: str  # the next fragment of the arguments' JSON text ("" in the first delta)


class ToolCallChunk(Struct, kw_only=True, omit_defaults=True):
    """A streamed call's delta: the first has its id, type and name, the rest only the next arguments fragment;
    `index` says which of a choice's calls it continues."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None  # always present, null when not asked for
    finish_reason: FinishReason | None = None  # always present, null until the last chunk


class ChatCompletionChunk(Struct, kw_only=True):
    """A streamed chat event; `usage` as CompletionChunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orcinus"


class AdapterCard(ModelCard, kw_only=True):
    """A LoRA adapter served as a model (vLLM's card): `parent` is the base model's id."""

    parent: str


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]  # AdapterCards among them


# --- decoding ---

T = TypeVar("T", CompletionRequest, ChatCompletionRequest)
_decoders: dict[type, msgspec.json.Decoder] = {}
# msgspec names a bad dict key "`key` in `$.path`": the param is the dict's
_AT = re.compile(r"^(?P<detail>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def _param(path: str) -> str | None:
    path = path.replace("[...]", "").lstrip(".")
    return path or None


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode and validate a request body; raises InvalidRequestError (400) naming the offending
    `param` (a path such as `max_tokens` or `messages[0].role`), or a 413 APIError for a huge body."""
    if len(body) > MAX_BODY_BYTES:
        raise request_too_large(MAX_BODY_BYTES)
    decoder = _decoders.get(kind) or _decoders.setdefault(kind, msgspec.json.Decoder(kind))
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        detail, param = m["detail"], _param(m["path"] or "")
        if missing := _FIELD.match(detail):
            field = missing["field"]
            param = f"{param}.{field}" if param else field
            raise InvalidRequestError(f"Missing required field `{param}`", param) from None
        if param is None and detail.startswith("Expected `object`"):
            raise InvalidRequestError(f"The request body must be a JSON object ({detail})", None) from None
        where = f" at `{param}`" if param else ""
        raise InvalidRequestError(f"Invalid {'key' if m['key'] else 'value'}{where}: {detail}", param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter on invalid UTF-8
        raise InvalidRequestError(f"Invalid JSON: {e}", None) from None
    except RecursionError:  # arrays and objects nested some hundreds deep, in any field (unknown ones too)
        raise InvalidRequestError("The request body nests arrays and objects too deeply", None) from None
    req.validate()
    return req
