"""Structured outputs: `response_format` constrains decoding with an llguidance grammar, so every output
parses and validates against its schema, on the engine (batched, preempted, pipelined) and through the
OpenAI SDK; bad schemas are 400s that name `response_format`."""

import json
import os

import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from gateway.api.protocol import JsonSchemaFormat, ResponseFormat
from gateway.api.structured import ANY_OBJECT, json_schema_grammar
from gateway.api.tools import FunctionDef, _parameters

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
# Bounded integers and closed objects: a schema that admits any extra property lets a 135M model add digits or keys until max_tokens.
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 3, "maximum": 7},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "array of strings": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["items"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {"title": NAME, "subtitle": NAME, "year": INT},
        "required": ["title"],
        "additionalProperties": False,
    },
    "array of objects": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"k": NAME, "v": {"type": "boolean"}},
                    "required": ["k", "v"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": INT, "y": INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "top-level array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "const and boolean": {
        "type": "object",
        "properties": {"kind": {"const": "ticket"}, "open": {"type": "boolean"}},
        "required": ["kind", "open"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {"id": {"anyOf": [INT, NAME]}},
        "required": ["id"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 16}},
        "required": ["note"],
        "additionalProperties": False,
    },
}
PROMPT = "Give me an example of the JSON data you would return for a small web form."


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint, dtype="float32")


def chat_prompt(llm, text=PROMPT) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def constrained(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120), grammar=json_schema_grammar(schema), **kw)


def test_every_output_validates_against_its_schema(llm):
    """A dozen schemas in one batch, greedy and sampled: each output parses and validates, and ends by itself."""
    names = sorted(SCHEMAS)
    params = [constrained(SCHEMAS[n], temperature=0.0) for n in names]
    params += [constrained(SCHEMAS[n], temperature=1.0, seed=7) for n in names]
    outs = llm.generate([chat_prompt(llm)] * len(params), params)
    for name, out in zip(names * 2, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_json_object_is_any_object_and_unconstrained_requests_in_the_batch_are_untouched(llm):
    prompt = chat_prompt(llm, "Say hello.")
    free = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([prompt] * 2, [constrained(ANY_OBJECT, temperature=0.0), free])
    assert isinstance(json.loads(outs[0].text), dict)
    assert outs[1].token_ids == llm.generate([prompt], free)[0].token_ids


def test_preempted_constrained_requests_stay_valid(checkpoint):
    """A preempted request recomputes its outputs as prompt; its new matcher replays them."""
    # 14 float32 blocks of the bundled model: too few for the six requests at once
    llm = LLM(
        checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", kv_cache_memory=14 * 737_280, max_num_seqs=8
    )
    schema = SCHEMAS["array of objects"]
    outs = llm.generate(
        [chat_prompt(llm, f"Example {i}, please.") for i in range(6)],
        constrained(schema, temperature=1.0, seed=3, max_tokens=150),
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)


def test_the_last_of_two_pipeline_stages_constrains_alike(llm):
    schema = SCHEMAS["nested"]
    want = llm.generate([chat_prompt(llm)], constrained(schema, temperature=0.0))[0]
    with LLM(model=None, dtype="float32", pipeline_stages=2) as piped:
        got = piped.generate([chat_prompt(llm)], constrained(schema, temperature=0.0))[0]
    assert got.token_ids == want.token_ids
    jsonschema.validate(json.loads(got.text), schema)


# ---------------------------------------------------------------- through the OpenAI SDK


def opened(schema):
    """The schema with every `additionalProperties` left unset, as most clients write them."""
    if isinstance(schema, dict):
        return {k: opened(v) for k, v in schema.items() if k != "additionalProperties"}
    return [opened(v) for v in schema] if isinstance(schema, list) else schema


def schema_format(name: str, strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name.replace(" ", "_"), "schema": opened(SCHEMAS[name]), "strict": strict},
    }


def test_strict_forbids_undeclared_keys_everywhere_and_only_when_asked():
    for name, closed in SCHEMAS.items():
        assert (
            ResponseFormat(
                type="json_schema", json_schema=JsonSchemaFormat(**schema_format(name)["json_schema"])
            ).schema()
            == closed
        ), name
    loose = schema_format("nested", strict=False)["json_schema"]
    assert ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(**loose)).schema() == loose["schema"]
    tool = FunctionDef(name="f", parameters=opened(SCHEMAS["nested"]), strict=True)
    assert _parameters(tool) == SCHEMAS["nested"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_streamed_and_whole_agree_and_validate(client, model, name):
    """OpenAI's strict mode on schemas that leave additionalProperties unset (issue 29): at max_tokens 200 each
    output ends by itself and validates against the closed schema."""
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 200,
        "temperature": 0,
        "response_format": schema_format(name),
    }
    whole = client.chat.completions.create(**kw)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices
    )
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMAS[name])


def test_json_object_and_n_2_and_completions(client, model):
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A user record."}],
        max_tokens=100,
        response_format={"type": "json_object"},
        temperature=0,
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    two = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        n=2,
        seed=1,
        max_tokens=150,
        temperature=1.0,
        response_format=schema_format("enum"),
    )
    assert len(two.choices) == 2
    for c in two.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["enum"])
    comp = client.completions.create(
        model=model,
        prompt="The data as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": schema_format("flat")},
    )
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMAS["flat"])


@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "unsupported JSON schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
            "unsupported JSON schema",
        ),
        ({"type": "json_schema"}, "needs `json_schema`"),
    ],
)
def test_a_bad_schema_is_a_400_naming_response_format(client, model, response_format, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], response_format=response_format
        )
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format" and message in err["message"]
    assert err["type"] == "invalid_request_error"


# ---------------------------------------------------------------- compiled once, off the step, sent once


def test_the_grammar_goes_to_the_engine_once_however_many_sequences_it_constrains():
    """Two prompts x n=3: one AddGrammar, six AddRequests naming it (no grammar text of their own), then the
    release, sent as soon as the last request is."""
    import asyncio

    from engine.ipc.messages import TokenDelta
    from gateway.api.generation import Generation
    from gateway.web.in_flight import InFlightLimit
    from gateway.web.metrics import Metrics

    sent = []

    class Client:
        async def add_grammar(self, grammar_id, grammar):
            sent.append(("grammar", grammar_id, grammar))

        async def add(self, request, queue, grammar_id):
            rid, params = request.request_id, request.params
            sent.append(("request", rid, params.grammar, grammar_id, params.seed))
            queue.put_nowait((rid, TokenDelta(rid, [7], "stop")))

        def release_grammar(self, grammar_id):
            sent.append(("release", grammar_id))

        release = abort = lambda self, rid: None

    metrics = Metrics()
    limit = InFlightLimit(8, 8, metrics)
    ticket = limit.reserve(6, 9)
    params = SamplingParams(max_tokens=4, seed=5, grammar="start: /[0-9]+/")
    gen = Generation(Client(), metrics, None, [[1, 2], [3]], params, 3, [], ticket)

    async def run():
        return [e async for e in gen.events()]

    events = asyncio.run(run())
    assert len(events) == 6 and limit.in_flight == 0
    kinds = [s[0] for s in sent]
    assert kinds == ["grammar"] + ["request"] * 6 + ["release"]
    gid = sent[0][1]
    assert sent[0][2] == params.grammar and sent[-1] == ("release", gid)
    assert all(s[2] is None and s[3] == gid for s in sent[1:-1])
    assert [s[4] for s in sent[1:-1]] == [5, 6, 7, 5, 6, 7]


def test_the_gate_holds_requests_until_their_grammar_compiles_and_gives_each_its_own_matcher(tokenizer):
    import threading

    from engine.core.request import EngineRequest
    from engine.ipc.grammar_gate import BACKGROUND_NICE, GrammarGate
    from engine.ipc.messages import AddGrammar, AddRequest
    from engine.model.sampling.grammar import GrammarCompiler

    compiler, go, woken = GrammarCompiler(tokenizer), threading.Event(), threading.Event()
    niceness = []

    def slow_compile(grammar):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        go.wait(30)
        return compiler.compile(grammar)

    gate = GrammarGate(slow_compile, woken.set)
    digits = json_schema_grammar({"type": "integer"})
    gate.add_grammar(AddGrammar("g", digits))
    gate.add_grammar(AddGrammar("bad", "this is not a grammar"))
    for rid, gid in (("a", "g"), ("b", "g"), ("c", "g"), ("x", "bad")):
        assert gate.park(AddRequest(EngineRequest(rid, [1], SamplingParams()), grammar_id=gid))
    assert not gate.park(AddRequest(EngineRequest("lost", [1], SamplingParams()), grammar_id="never-sent"))
    assert gate.abort("c") and not gate.abort("c")
    gate.release("g")
    assert not gate.park(AddRequest(EngineRequest("late", [1], SamplingParams()), grammar_id="g"))  # released
    assert gate.ready() == [] and gate.busy  # still compiling
    go.set()
    assert woken.wait(30)
    done = {}
    while len(done) < 3:
        done.update({c.request.request.request_id: c for c in gate.ready()})
    assert set(done) == {"a", "b", "x"}
    a, b, x = done["a"], done["b"], done["x"]
    assert a.grammar == digits and a.error is None and a.matcher is not b.matcher
    assert a.matcher.consume_tokens(tokenizer.encode("12")) and not b.matcher.is_error()
    assert b.matcher.validate_tokens(tokenizer.encode("345")) == len(tokenizer.encode("345"))  # b is fresh
    assert x.matcher is None and "invalid grammar" in x.error
    # Compiles yield the CPU to decoding: on a 2-core machine they would otherwise stretch every step.
    assert niceness == [BACKGROUND_NICE, BACKGROUND_NICE] and os.getpriority(os.PRIO_PROCESS, 0) < BACKGROUND_NICE
    gate.release("bad")
    assert not gate.busy  # both released, nothing waits: nothing is held
    gate.close()


def test_requests_sharing_a_grammar_compile_it_once_in_the_sampler(llm, monkeypatch):
    from engine.model.sampling import grammar as grammar_module

    calls = []
    real = grammar_module.GrammarCompiler.compile
    monkeypatch.setattr(grammar_module.GrammarCompiler, "compile", lambda self, g: calls.append(g) or real(self, g))
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "maybe so"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }  # no other test's: the sampler has not kept its grammar
    params = constrained(schema, temperature=1.0, max_tokens=40)
    outs = llm.generate([chat_prompt(llm)] * 4, [SamplingParams(**{**_fields(params), "seed": i}) for i in range(4)])
    assert len(calls) == 1
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)


def _fields(params: SamplingParams) -> dict:
    import msgspec

    return msgspec.structs.asdict(params)


def test_a_failing_matcher_beside_a_drafting_one_leaves_that_one_where_its_step_began(tokenizer):
    """A grammar error in one row rolls the other rows' matchers back from their drafts, so the request-by-request
    retry (the executor's, after a failed batch) masks each from where its step began."""
    import torch

    from engine.model.sampling.grammar import GrammarCompiler, GrammarError
    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    ids = tokenizer.encode('"yes sir"')  # '"', 'yes', ' sir', '"'
    grammar = json_schema_grammar({"enum": ["yes sir"]})
    sampler = Sampler(tokenizer=tokenizer)
    drafting = SamplingState("drafting", [1], SamplingParams(temperature=0.0, grammar=grammar), frozenset())
    broken = SamplingState(
        "broken",
        [1],
        SamplingParams(temperature=0.0, grammar="not a grammar"),
        frozenset(),
        matcher=GrammarCompiler(tokenizer).compile("this is not a grammar"),
    )
    sampler.add(drafting)
    sampler.add(broken)
    logits = torch.zeros(3, tokenizer.vocab_size)
    logits[[0, 1, 2], ids[:3]] = 10.0  # each row's likeliest token: the drafts, then ' sir'
    with pytest.raises(GrammarError):
        sampler.sample(torch.cat([logits, torch.zeros(1, tokenizer.vocab_size)]), ["drafting", "broken"], [ids[:2], []])
    assert sampler(logits, ["drafting"], [ids[:2]])["drafting"].token_ids == ids[:3]
