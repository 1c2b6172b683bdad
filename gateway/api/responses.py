"""POST /v1/responses (streamed and not), GET and DELETE /v1/responses/{id}.

A response runs as a chat completion (gateway/api/chat.py's start_chat): the request's instructions, the stored turns
of `previous_response_id` and its input items become the messages; its output is a message item, or function_call
items when the model calls tools. Streamed, the output comes as OpenAI's typed events, each item opened, filled
(text deltas, argument deltas) and closed; a kept response (`store`) can be continued and read back.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.core.sampling_params import InvalidRequestError
from gateway.api.chat import ChatRun, start_chat
from gateway.api.protocol import ChatMessage, decode_request
from gateway.api.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
    renamed,
)
from gateway.api.serving import ServerState, as_api_error, json_response, read_body, until_done_or_disconnect
from gateway.api.tool_stream import ToolCallStream
from gateway.api.tools import FunctionCall, ToolCall, call_arguments
from gateway.engines.client import EngineUnavailableError
from gateway.web import errors
from gateway.web.auth import TENANT


def _owner(request: Request) -> bytes:
    """Whose responses these are: the API key the request came with (all one owner without keys)."""
    return request.scope.get("state", {}).get(TENANT) or b""


async def create_response(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), ResponsesRequest)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id, _owner(request))
        if previous is None:
            raise errors.invalid_request(
                f"Previous response with id '{req.previous_response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = previous.messages
    chat = req.to_chat(history)
    try:
        run = await start_chat(chat, request, state)  # admitted from here: close() its generation
    except InvalidRequestError as e:  # its schemas and its prompt's length are checked there
        raise renamed(e) from None
    turn = Turn(req, run, state, chat.messages[1 if req.instructions else 0 :], _owner(request))
    if req.stream:
        return state.sse(turn.events(), on_close=run.gen.close, named=True)
    try:
        return await until_done_or_disconnect(request, turn.collect())
    finally:
        run.gen.close()


async def retrieve_response(request: Request, state: ServerState) -> Response:
    stored = state.responses.get(request.path_params["response_id"], _owner(request))
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return Response(stored.body, media_type="application/json")


async def delete_response(request: Request, state: ServerState) -> Response:
    response_id = request.path_params["response_id"]
    if not state.responses.delete(response_id, _owner(request)):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


_FAILURE_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}  # by HTTP status: a response's error codes


def _carried(call: ToolCall) -> bool:
    """Whether a call can go into the kept conversation: a later turn checks every call's arguments, and a stream's
    call cut short by max_output_tokens (or written as no JSON) would make each continuation a 400."""
    try:
        call_arguments(call, "")
    except InvalidRequestError:
        return False
    return True


def _not_found(response_id: str) -> errors.APIError:
    return errors.APIError(
        404, f"Response with id '{response_id}' not found.", "not_found_error", "response_id", "response_not_found"
    )


class Turn:
    """One response being made: its id, its output items as they form, and the stored conversation after it."""

    def __init__(
        self, req: ResponsesRequest, run: ChatRun, state: ServerState, messages: list[ChatMessage], owner: bytes
    ):
        self.req, self.run, self.state, self.messages, self.owner = req, run, state, messages, owner
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.output: list[OutputMessage | FunctionCallItem] = []
        self.current: OutputMessage | FunctionCallItem | None = None  # the item being filled; one at a time
        self.seq = 0

    def response(self, status: str, finish: str | None = None, error: ResponseError | None = None) -> ResponseObject:
        req, params = self.req, self.run.gen.params
        usage = None
        if status != "in_progress":
            prompt, completion, cached = self.run.gen.token_counts
            usage = ResponseUsage(
                input_tokens=prompt,
                output_tokens=completion,
                total_tokens=prompt + completion,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
            )
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            model=self.run.model,
            output=list(self.output),
            usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if finish == "length" else None,
            error=error,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            # unset: the values sampled with, as OpenAI echoes its defaults
            temperature=params.temperature if req.temperature is None else req.temperature,
            top_p=params.top_p if req.top_p is None else req.top_p,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=self.run.parallel,
            text=req.text or TextConfig(),
            store=req.store,
            metadata=req.metadata or {},
        )

    def finish(self, finish: str | None) -> ResponseObject:
        """The final response; kept (with the conversation through it) when the request said `store`."""
        response = self.response("incomplete" if finish == "length" else "completed", finish)
        if self.req.store:
            said = [m for m in self.output if isinstance(m, OutputMessage)]
            made = [
                ToolCall(id=c.call_id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in self.output
                if isinstance(c, FunctionCallItem)
            ]
            calls = [c for c in made if _carried(c)]
            text = "".join(part.text for m in said for part in m.content)
            reply = ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)
            self.state.responses.put(self.id, self.owner, self.messages + [reply], response)
        return response

    async def collect(self) -> Response:
        texts, finish = [], None
        async for event in self.run.gen.events():
            texts.append(event.text)
            finish = event.finish_reason or finish
        text = "".join(texts)
        calls = self.run.plan.parse_calls(text, self.run.parallel) if finish == "stop" else []
        status = "incomplete" if finish == "length" else "completed"
        if calls:
            self.output = [
                FunctionCallItem(
                    id=f"fc_{uuid.uuid4().hex}",
                    call_id=c.id,
                    name=c.function.name,
                    arguments=c.function.arguments,
                    status="completed",
                )
                for c in calls
            ]
        else:
            self.output = [OutputMessage(id=f"msg_{uuid.uuid4().hex}", status=status, content=[OutputText(text=text)])]
        return json_response(self.finish(finish))

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    async def events(self):
        """The stream: created, in_progress, each item added, filled and done before the next is added, then
        completed or incomplete; a failure part-way is an `error` event, then response.failed."""
        yield ResponseEvent(
            type="response.created", sequence_number=self._next(), response=self.response("in_progress")
        )
        yield ResponseEvent(
            type="response.in_progress", sequence_number=self._next(), response=self.response("in_progress")
        )
        try:
            async for e in self._items():
                yield e
        except (EngineUnavailableError, InvalidRequestError, errors.APIError) as error:
            for e in self._fail(as_api_error(error)):
                yield e

    async def _items(self):
        calls = ToolCallStream(self.run.plan, self.run.parallel) if self.run.plan.active else None
        open_calls: dict[int, FunctionCallItem] = {}  # by the call's index in the choice
        finish = None
        async for event in self.run.gen.events():
            text, chunks, finish = event.text, [], event.finish_reason or finish
            if calls is not None:
                text, chunks = calls.feed(event.text)
                if finish:
                    rest, more, _ = calls.finish(finish == "stop")
                    text, chunks = text + rest, chunks + more
            if text:
                if not isinstance(self.current, OutputMessage):
                    for e in self._open_message():
                        yield e
                message = self.current
                message.content[0].text += text
                yield TextDeltaEvent(
                    sequence_number=self._next(),
                    item_id=message.id,
                    output_index=self.output.index(message),
                    delta=text,
                )
            for chunk in chunks:
                item = open_calls.get(chunk.index)
                if item is None:
                    item = open_calls[chunk.index] = FunctionCallItem(
                        id=f"fc_{uuid.uuid4().hex}",
                        call_id=chunk.id or f"call_{uuid.uuid4().hex[:24]}",
                        name=chunk.function.name or "",
                        arguments="",
                        status="in_progress",
                    )
                    for e in self._open(item):
                        yield e
                if chunk.function.arguments:
                    item.arguments += chunk.function.arguments
                    yield ArgumentsDeltaEvent(
                        sequence_number=self._next(),
                        item_id=item.id,
                        output_index=self.output.index(item),
                        delta=chunk.function.arguments,
                    )
        if not self.output:  # no text: one empty message, as the whole response has
            for e in self._open_message():
                yield e
        for e in self._close("incomplete" if finish == "length" else "completed"):
            yield e
        final = self.finish(finish)
        yield ResponseEvent(type=f"response.{final.status}", sequence_number=self._next(), response=final)

    def _open_message(self):
        message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        yield from self._open(message)
        yield ContentPartEvent(
            type="response.content_part.added",
            sequence_number=self._next(),
            item_id=message.id,
            output_index=self.output.index(message),
            part=OutputText(text=""),
        )
        message.content.append(OutputText(text=""))

    def _open(self, item: OutputMessage | FunctionCallItem):
        # Each event is encoded as it is yielded (gateway/api/serving.py's sse), so it shows the item as it is now.
        yield from self._close("completed")
        self.output.append(item)
        self.current = item
        yield OutputItemEvent(
            type="response.output_item.added",
            sequence_number=self._next(),
            output_index=len(self.output) - 1,
            item=item,
        )

    def _close(self, status: str):
        """The done events of the item being filled, if any: a new item comes only after them."""
        item, self.current = self.current, None
        if item is None:
            return
        index = self.output.index(item)
        item.status = status
        if isinstance(item, OutputMessage):
            yield TextDoneEvent(
                sequence_number=self._next(), item_id=item.id, output_index=index, text=item.content[0].text
            )
            yield ContentPartEvent(
                type="response.content_part.done",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=index,
                part=item.content[0],
            )
        else:
            yield ArgumentsDoneEvent(
                sequence_number=self._next(),
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
        yield OutputItemEvent(
            type="response.output_item.done", sequence_number=self._next(), output_index=index, item=item
        )

    def _fail(self, error: errors.APIError):
        """An `error` event, then response.failed with what was made so far (not kept: it cannot be continued)."""
        if self.current is not None:
            self.current.status = "incomplete"
        yield ErrorEvent(
            sequence_number=self._next(), code=error.code or error.type, message=error.message, param=error.param
        )
        code = _FAILURE_CODES.get(error.status, "server_error")
        yield ResponseEvent(
            type="response.failed",
            sequence_number=self._next(),
            response=self.response("failed", error=ResponseError(code=code, message=error.message)),
        )
