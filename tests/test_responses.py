"""The Responses API through the official SDK and LangChain: a response is the chat completion of the same messages
(tokens and usage), streamed as OpenAI's typed events in order, continued with `previous_response_id` (a function
tool's call and its output included), kept and deleted per API key, and bad input is a 400 in OpenAI's shape."""

import asyncio
import json
from types import SimpleNamespace
from typing import get_args

import httpx
import jsonschema
import msgspec
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from engine.core.sampling_params import InvalidRequestError, SamplingParams
from gateway.api.chat import ChatRun
from gateway.api.generation import ChoiceEvent
from gateway.api.protocol import ChatMessage, decode_request
from gateway.api.response_store import ResponseStore
from gateway.api.responses import Turn
from gateway.api.responses_protocol import ResponsesRequest
from gateway.web import errors

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24}},
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
GREEDY = {"temperature": 0, "max_output_tokens": 12}
# The official SDK's typed events, by their `type`: the models a client validates against.
SDK_EVENTS = {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(get_args(ResponseStreamEvent)[0])}


DEEP = {"type": "object"}
for _ in range(70):  # past MAX_JSON_DEPTH
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def sdk_events(events) -> list:
    """Each streamed event (the SDK's as it received them, or ours) validated as the SDK's model of its type."""
    out = []
    for e in events:
        data = e.to_dict() if hasattr(e, "to_dict") else msgspec.to_builtins(e)  # to_dict: the fields as sent
        out.append(SDK_EVENTS[data["type"]].model_validate(data))
    return out


def chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12, **kw)


def test_a_response_is_the_chat_completion_of_its_messages(client, model):
    r = client.responses.create(model=model, input="Name three colors.", instructions="Answer briefly.", **GREEDY)
    c = chat(
        client,
        model,
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}],
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_streamed_events_come_in_order_and_add_up_to_the_response(client, model):
    whole = client.responses.create(model=model, input="Count to five.", **GREEDY)
    events = sdk_events(client.responses.create(model=model, input="Count to five.", stream=True, **GREEDY))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert deltas == list(range(4, 4 + len(deltas))) and deltas
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    text = "".join(events[i].delta for i in deltas)
    assert text == whole.output_text == events[-1].response.output_text == events[4 + len(deltas)].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", **GREEDY)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id, **GREEDY)
    c = chat(
        client,
        model,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert second.output_text == c.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_function_tool_round_trip(client, model):
    kw = {
        "model": model,
        "input": "What is the weather like in Paris?",
        "tools": [WEATHER],
        "temperature": 0,
        "max_output_tokens": 80,
    }
    r = client.responses.create(**kw, tool_choice="required")
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # streamed: the item opens with its name, the arguments come as deltas and add up to the same text
    events = sdk_events(client.responses.create(**kw, tool_choice="required", stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (
        args == call.arguments == next(e for e in events if e.type == "response.function_call_arguments.done").arguments
    )
    # the call's output goes back, continuing the stored response: the same prompt as chat's tool message
    out = client.responses.create(
        model=model,
        previous_response_id=r.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
    )
    c = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=30,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "user", "content": "What is the weather like in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
        ],
    )
    assert out.usage.input_tokens == c.usage.prompt_tokens
    assert out.usage.output_tokens == c.usage.completion_tokens
    if c.choices[0].message.tool_calls:
        assert [o.arguments for o in out.output] == [t.function.arguments for t in c.choices[0].message.tool_calls]
    else:
        assert out.output_text == c.choices[0].message.content


def test_a_json_schema_text_format_gives_a_valid_document(client, model):
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    }
    r = client.responses.create(
        model=model,
        input="Describe a person.",
        temperature=0,
        max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )
    value = json.loads(r.output_text)
    jsonschema.validate(value, schema)
    assert set(value) == {"name", "age"}  # strict: no undeclared keys


def test_kept_responses_can_be_deleted_and_unknown_ones_are_errors(client, model, server):
    r = client.responses.create(model=model, input="Hi.", **GREEDY)
    assert httpx.delete(f"{server}/v1/responses/{r.id}").json() == {
        "id": r.id,
        "object": "response.deleted",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="Hi.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=model, input="Hi.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "message", "role": "user"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}},
            "text.format",
        ),
        ({"input": "x", "tools": [{**WEATHER, "strict": True, "parameters": DEEP}]}, "tools"),
        ({"input": "hi " * 9000}, "input"),  # past the context window
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI's limits: 16 pairs,
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),  # keys up to 64 characters,
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),  # values up to 512
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_langchain_on_the_responses_api(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server}/v1", api_key="unused", model=model, temperature=0, max_tokens=12, use_responses_api=True
    )
    whole = llm.invoke("Name a fruit.")
    assert whole.response_metadata["id"].startswith("resp_") and whole.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream("Name a fruit."))
    assert streamed == whole.text
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server}/v1", api_key="unused", model=model, temperature=0, max_tokens=80, use_responses_api=True
    )
    tools = llm.bind_tools([CHAT_WEATHER], tool_choice="get_weather")
    [call] = tools.invoke("What is the weather in Rome?").tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}


def test_the_store_keeps_each_keys_responses_apart_and_drops_the_oldest():
    store = ResponseStore(key_responses=2)
    said = [ChatMessage(role="user", content="x" * 10)]
    store.put("a", b"key1", said, {"id": "a"})
    assert store.get("a", b"key2") is None and json.loads(store.get("a", b"key1").body) == {"id": "a"}
    assert store.get("a", b"key1").messages == said
    assert not store.delete("a", b"key2")
    store.put("b", b"key1", said, {"id": "b"})
    store.put("c", b"key1", said, {"id": "c"})  # over the count: the least recently used goes
    assert store.get("a", b"key1") is None and store.get("c", b"key1") is not None


def test_one_key_cannot_evict_anothers_responses():
    store = ResponseStore()  # the server's bounds
    said = [ChatMessage(role="user", content="x")]
    store.put("a", b"key1", said, {})
    for i in range(5000):
        store.put(f"b{i}", b"key2", said, {})
    assert store.get("a", b"key1") is not None and store.get("b0", b"key2") is None  # key2 lost its own oldest


def test_every_stored_byte_counts_and_the_fullest_key_gives_way():
    said = [ChatMessage(role="user", content="x")]
    big = {"metadata": {f"k{i}": "v" * 512 for i in range(16)}, "instructions": "i" * 4000}  # ~12 KB
    store = ResponseStore(key_bytes=30_000)
    store.put("a", b"key1", said, big)
    store.put("b", b"key1", said, big)
    assert store.count == 2 and store.bytes > 2 * len(msgspec.json.encode(big))
    store.put("c", b"key1", said, big)  # what the response keeps counts, not only the conversation
    assert store.get("a", b"key1") is None and store.get("c", b"key1") is not None
    # All keys together: past the total, the key holding the most gives up its oldest, not the others.
    store = ResponseStore(key_bytes=30_000, max_bytes=35_000)
    store.put("small", b"key1", said, {})
    store.put("a", b"key2", said, big)
    store.put("b", b"key2", said, big)  # within its own bound
    store.put("d", b"key3", said, big)  # over the total: key2 holds the most
    assert store.get("small", b"key1") is not None and store.get("d", b"key3") is not None
    assert store.get("a", b"key2") is None and store.get("b", b"key2") is not None
    assert store.count == 3 and store.bytes <= 35_000


def test_metadata_is_echoed_as_sent_and_unset_sampling_fields_echo_the_defaults_used(client, model):
    metadata = {f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: "é"}  # OpenAI's limits, each reached
    r = client.responses.create(model=model, input="Hi.", max_output_tokens=1, metadata=metadata)
    assert r.metadata == metadata and client.responses.retrieve(r.id).metadata == metadata
    assert (r.temperature, r.top_p) == (1.0, 1.0)  # SamplingParams' defaults, which the engine sampled with
    assert (
        client.responses.create(
            model=model, input="Hi.", max_output_tokens=1, store=False, temperature=0.5, top_p=0.25
        ).top_p
    ) == 0.25


# Turn on a scripted generation: the stream's shape where the model would rarely go (parallel calls, no text, a
# failure part-way), with no server.
class ScriptedGeneration:
    def __init__(self, texts: list[str], finish: str = "stop", error: Exception | None = None):
        self.texts, self.finish, self.error = texts, finish, error
        self.params, self.token_counts = SamplingParams(), (7, len(texts), 0)

    async def events(self):
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1 and self.error is None
            yield ChoiceEvent(0, text, [], [], [], self.finish if last else None)
        if self.error is not None:
            raise self.error


def scripted_turn(texts: list[str], error: Exception | None = None, finish: str = "stop", **body) -> Turn:
    req = decode_request(json.dumps({"input": "Weather in Paris and Rome?", **body}).encode(), ResponsesRequest)
    chat = req.to_chat([])
    gen = ScriptedGeneration(texts, finish, error)
    run = ChatRun(gen, chat.tool_plan(), chat.parallel_tool_calls is not False, None, "m")
    return Turn(req, run, SimpleNamespace(model_name="m", responses=ResponseStore()), chat.messages, b"")


def streamed(turn: Turn) -> list:
    async def collect():
        return [e async for e in turn.events()]

    return sdk_events(asyncio.run(collect()))


def whole(turn: Turn) -> Response:
    return Response.model_validate_json(asyncio.run(turn.collect()).body)


def test_parallel_calls_are_each_closed_before_the_next_is_added():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    events = streamed(scripted_turn(pieces, tools=[WEATHER]))
    opened = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert opened == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 1),
    ]
    after_first = [e for e in events[[e.type for e in events].index("response.output_item.done") :]]
    assert all(getattr(e, "output_index", 1) == 1 for e in after_first[1:])  # nothing more about the first
    final = events[-1].response
    assert events[-1].type == "response.completed" and [c.status for c in final.output] == ["completed"] * 2
    assert [c.arguments for c in final.output] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert [c.arguments for c in whole(scripted_turn(pieces, tools=[WEATHER])).output] == [
        c.arguments for c in final.output
    ]


def test_an_empty_output_is_the_same_streamed_and_whole():
    events = streamed(scripted_turn([""]))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    shape = [(o.type, o.status, [(c.type, c.text) for c in o.content]) for o in events[-1].response.output]
    assert shape == [("message", "completed", [("output_text", "")])]
    assert [
        (o.type, o.status, [(c.type, c.text) for c in o.content]) for o in whole(scripted_turn([""])).output
    ] == shape


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    error = errors.APIError(500, "sampling failed", "server_error")
    events = streamed(scripted_turn(["Sunny ", "and"], error=error, max_output_tokens=5))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert (events[-2].code, events[-2].message) == ("server_error", "sampling failed")
    failed = events[-1].response
    assert failed.status == "failed" and (failed.error.code, failed.error.message) == (
        "server_error",
        "sampling failed",
    )
    assert failed.output[0].content[0].text == "Sunny and" and failed.usage.output_tokens == 2


def test_a_kept_response_whose_call_max_output_tokens_cut_short_can_be_continued():
    pieces = ['{"name": "get_weather", "arguments": {"ci', 'ty": "Par']
    turn = scripted_turn(pieces, finish="length", tools=[WEATHER], tool_choice="required", max_output_tokens=9)
    final = streamed(turn)[-1].response
    assert final.status == "incomplete" and final.output[0].arguments == '{"city": "Par'
    history = turn.state.responses.get(turn.id, b"").messages
    then = decode_request(json.dumps({"input": "Go on."}).encode(), ResponsesRequest)
    assert [m.role for m in then.to_chat(history).messages] == ["user", "assistant", "user"]  # was a 400
    assert [(m.role, m.tool_calls) for m in history] == [
        ("user", None),
        ("assistant", None),
    ]  # the cut call is not kept


def test_cache_salt_carries_into_the_chat_request_it_runs_as():
    """vLLM's field, as on chat: dropped, a salted response would share cached prefixes with the key's unsalted ones."""
    req = decode_request(b'{"input": "hi", "cache_salt": "user-42-f0e1"}', ResponsesRequest)
    assert req.to_chat([]).cache_salt == "user-42-f0e1"
    assert decode_request(b'{"input": "hi"}', ResponsesRequest).to_chat([]).cache_salt is None
    with pytest.raises(InvalidRequestError) as e:
        decode_request(b'{"input": "hi", "cache_salt": ""}', ResponsesRequest)
    assert e.value.param == "cache_salt"
