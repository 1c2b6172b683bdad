"""Tool calling through the OpenAI SDK: a named or required tool_choice always yields a valid call, streamed
deltas (the name first, then argument fragments) assemble to the whole response, several calls come when the model
makes them and `parallel_tool_calls` allows, `auto` answers are well formed, history with calls is accepted, and
unknown tools or bad schemas are 400s, and a schema compiles once however often a request asks."""

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["a", "b"],
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
        },
    },
}
TOOLS = [WEATHER, ADD]
DEEP = {"type": "object"}
for _ in range(70):  # past MAX_JSON_DEPTH
    DEEP = {"type": "object", "properties": {"a": DEEP}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_call(choice, name=None):
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return call


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client, model, name):
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    check_call(r.choices[0], name)


def test_required_calls_one_of_the_tools_and_n_2_gives_two_calls(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, n=2, temperature=1.0, seed=5
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        check_call(choice)


def test_streamed_tool_call_deltas_assemble_to_the_whole_response(client, model):
    kw = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    whole = check_call(client.chat.completions.create(**kw).choices[0], "get_weather")
    name, args, finish, content = None, "", None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, json.loads(args), finish, content) == (
        "get_weather",
        json.loads(whole.function.arguments),
        "tool_calls",
        "",
    )


def test_auto_answers_in_text_or_with_a_valid_call_and_none_never_calls(client, model):
    for choice in ("auto", None):
        r = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0
        )
        c = r.choices[0]
        if c.message.tool_calls:
            check_call(c)
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_auto_turns_a_call_shaped_answer_into_a_tool_call_whole_and_streamed(client, model):
    """Deterministic: a response_format holding the call's shape makes the answer one, and `auto` must read it as
    a call (finish_reason tool_calls, no content), streamed deltas assembling to the same call."""
    call_schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"}, "arguments": SCHEMAS["get_weather"]},
    }
    kw = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema}},
    }
    whole = check_call(client.chat.completions.create(**kw).choices[0], "get_weather")
    name, args, finish, content = None, "", None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, json.loads(args), finish, content) == (
        "get_weather",
        json.loads(whole.function.arguments),
        "tool_calls",
        "",
    )


def plan_of(choice="auto"):
    from gateway.api.protocol import ChatCompletionRequest, decode_request

    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest).tool_plan()


def streamed(plan, pieces, parallel=True, stopped=True):
    """Feed `pieces` to a ToolCallStream: (content, [(index, id, name, arguments fragment)], made calls)."""
    from gateway.api.tool_stream import ToolCallStream

    stream, content, deltas = ToolCallStream(plan, parallel), "", []
    for piece in pieces:
        text, calls = stream.feed(piece)
        content += text
        deltas += [(c.index, c.id, c.function.name, c.function.arguments) for c in calls]
    text, calls, made = stream.finish(stopped)
    return content + text, deltas + [(c.index, c.id, c.function.name, c.function.arguments) for c in calls], made


def test_a_streamed_call_sends_its_name_first_then_its_arguments_as_they_come():
    pieces = [
        '<tool_call>{"na',
        'me": "get_weather", "argu',
        'ments": {"ci',
        'ty": "Pa{r}\\"is"',
        ', "unit": "cel',
        'sius"}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2]}}',
        "</tool_call>",
    ]
    content, deltas, made = streamed(plan_of(), pieces)
    assert content == "" and made
    (i0, id0, name0, a0), *rest = deltas
    assert (i0, name0, a0) == (0, "get_weather", "") and id0.startswith("call_")
    first = [d for d in rest if d[0] == 0]
    assert all(d[1] is None and d[2] is None for d in first) and len(first) == 4  # fragments as they came
    assert json.loads("".join(d[3] for d in first)) == {"city": 'Pa{r}"is', "unit": "celsius"}
    second = [d for d in rest if d[0] == 1]
    assert second[0][2] == "add" and second[0][1] not in (None, id0)
    assert json.loads("".join(d[3] for d in second)) == {"a": 1, "b": [2]}
    # Without parallel calls the first is the only one; as an array, the same calls.
    assert {d[0] for d in streamed(plan_of(), pieces, parallel=False)[1]} == {0}
    array = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    assert [d[2] for d in streamed(plan_of(), [array])[1] if d[2]] == ["add", "add"]


def test_a_streamed_answer_that_is_no_call_is_content_and_one_that_parses_late_is_whole_calls():
    assert streamed(plan_of(), ["  Hello", " there"]) == ("  Hello there", [], False)  # sent as it comes
    assert streamed(plan_of(), ['{"answer": ', "42}"]) == ('{"answer": 42}', [], False)  # held, then content
    assert streamed(plan_of(), ['{"name": "nope", "arguments": {}}']) == (
        '{"name": "nope", "arguments": {}}',
        [],
        False,
    )
    late = '{"arguments": {"a": 1, "b": 2}, "name": "add"}'  # the name after the arguments: whole at the end
    content, [(index, _call_id, name, args)], made = streamed(plan_of(), [late])
    assert (content, index, name, json.loads(args), made) == ("", 0, "add", {"a": 1, "b": 2}, True)
    assert streamed(plan_of(), [late], stopped=False)[2] is False  # cut off by max_tokens: content
    # A required call holds even plain-looking text until the end.
    assert streamed(plan_of("required"), ["Hello"]) == ("Hello", [], False)


def test_an_answer_nested_past_json_s_recursion_limit_is_content_whole_and_streamed():
    deep = "[" * 2000  # what a model looping on "[[" writes before its eos
    assert plan_of().parse_calls(deep) == []
    assert streamed(plan_of(), [deep[:1000], deep[1000:]]) == (deep, [], False)


def test_several_calls_come_as_several_tool_calls_whole_and_streamed_unless_parallel_calls_are_off(client, model):
    """Deterministic: a response_format of an array of two calls makes the answer two calls."""
    call = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "arguments"],
        "properties": {"name": {"const": "add"}, "arguments": SCHEMAS["add"]},
    }
    kw = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "calls", "schema": {"type": "array", "items": call, "minItems": 2, "maxItems": 2}},
        },
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 2
    assert len({c.id for c in whole.message.tool_calls}) == 2
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [c.function.arguments for c in one.message.tool_calls] == [whole.message.tool_calls[0].function.arguments]


def test_a_history_with_a_call_and_its_result_is_accepted(client, model):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": DEEP}}]}, "tools"),
    ],
)
def test_bad_tools_are_400s(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_a_template_that_renders_tools_gets_them_and_its_wrappers_are_understood(tokenizer):
    import copy

    from gateway.api.protocol import ChatCompletionRequest, decode_request

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    tok._template = None
    assert tok.renders_tools and not tokenizer.renders_tools
    req = decode_request(json.dumps({"messages": ASK, "tools": TOOLS}).encode(), ChatCompletionRequest)
    plan = req.tool_plan()
    text = tok.apply_chat_template(req.template_messages(), tools=plan.template_tools())
    assert text == "[tool get_weather][tool add]<user>What is the weather like in Paris today?"
    [call] = plan.parse_calls('<tool_call>\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n</tool_call>')
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert plan.parse_calls('{"name": "nope", "arguments": {}}') == [] and plan.parse_calls("[1, 2]") == []


def test_each_schema_of_a_request_compiles_once_however_often_it_is_asked_for():
    """In the gateway's pool, off the event loop: the two functions' parameters and the call object of either
    compile once, for three requests of which two ask at the same time."""
    import asyncio
    from types import SimpleNamespace

    from gateway.api.protocol import ChatCompletionRequest, decode_request
    from gateway.api.serving import ServerState
    from gateway.api.structured import SchemaCompiler

    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 5}
    state = SimpleNamespace(grammars=SchemaCompiler())

    async def three():
        reqs = [decode_request(json.dumps(body).encode(), ChatCompletionRequest) for _ in range(3)]
        first = await asyncio.gather(*(ServerState.grammar(state, r) for r in reqs[:2]))
        return [*first, await ServerState.grammar(state, reqs[2])], reqs[0]

    grammars, req = asyncio.run(three())
    state.grammars.close()
    assert state.grammars.compiled == 3
    assert grammars[0] and grammars[0] == grammars[1] == grammars[2]
    assert req.to_sampling_params(grammar=grammars[0]).grammar == grammars[0]
