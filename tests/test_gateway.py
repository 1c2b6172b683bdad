"""The OpenAI-compatible gateway end to end: one live `orcinus serve` (the `server` fixture in conftest.py),
driven by the `openai` SDK and raw httpx. Greedy results are checked against the offline `LLM`."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import parse_metrics, wait_for_metrics

from engine import LLM, SamplingParams
from gateway.api.detokenizer import token_text

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint=checkpoint)  # the servers' defaults (conftest): float32 on the file's blocks


def complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines) -> tuple[list[dict], bool]:
    """The JSON events of an SSE stream and whether it ended with `data: [DONE]` (nothing after it)."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, `: ping` comments
        assert not done, f"data after [DONE]: {line!r}"
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def stream(http: httpx.Client, path: str = "/v1/completions", **body) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events, done = sse_events(r.iter_lines())
    assert done, "the stream did not end with data: [DONE]"
    assert all("error" not in e for e in events), events
    return events


def stream_text(events: list[dict], index: int = 0) -> str:
    return "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)


def finish_reasons(events: list[dict], index: int = 0) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["index"] == index and c["finish_reason"]]


def metrics(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def gauges(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith(("orcinus_requests_", "orcinus_kv_"))}


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once the engine runs and waits for nothing and its KV use has settled."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        m = metrics(http)
        if m["orcinus_requests_running"] == 0 and m["orcinus_requests_waiting"] == 0:
            if last is not None and last["orcinus_kv_blocks_used"] == m["orcinus_kv_blocks_used"]:
                return m
            last = m
        else:
            last = None
        time.sleep(0.3)
    pytest.fail(f"the engine did not go idle within {timeout}s: {gauges(metrics(http))}")


def wait_for(http: httpx.Client, pred, timeout: float, what: str) -> dict[str, float]:
    return wait_for_metrics(lambda: metrics(http), pred, timeout, what)


# ---------------------------------------------------------------- basics


def test_health_and_models(server, client, http):
    assert http.get("/health").status_code == 200
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["id"] == MODEL
    one = client.models.retrieve(MODEL)
    assert (one.id, one.object) == (MODEL, "model") and http.get(f"/v1/models/{MODEL}").json() == raw["data"][0]
    r = http.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_completion_non_streaming_and_streaming_agree(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    [choice] = full.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.text
    assert full.usage.prompt_tokens == 5 and 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert len(chunks) >= 2
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= full.usage.completion_tokens <= 8

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n_choices(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=0.9, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5  # the prompt counts once, as OpenAI

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            n=2,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] and texts[0] == texts[1]  # greedy: both choices alike


def test_a_seed_draws_one_text_whether_its_prompt_is_cached_or_not(client):
    """The first request computes its prompt; the next find it in the prefix cache and attend its last tokens as
    decode queries, which moves the logits' last bits: a seeded draw must not move with them."""
    messages = [{"role": "user", "content": "Write a haiku about the sea at dawn, as a lighthouse keeper would."}]
    texts = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.9, seed=seed)
        .choices[0]
        .message.content
        for seed in (1, 1, 1, 2)
    ]
    assert texts[0] == texts[1] == texts[2] and texts[3] != texts[0], texts


def test_stop_list(client):
    base = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert "." in base, base
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["zzqq", "."], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == base[: base.index(".")]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs_structure(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == 8
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(logprob, float) and logprob <= 0
        assert 1 <= len(top) <= 3
        assert all(v <= 0 for v in top.values())
        assert top[token] == pytest.approx(logprob)  # greedy: the chosen token is the most likely one
        assert logprob == pytest.approx(max(top.values()))

    r0 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert all(len(t) <= 1 for t in r0.choices[0].logprobs.top_logprobs)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or t.token.startswith("bytes:")


def test_echo(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_echo_offsets_index_the_returned_text(http, llm):
    """Each token's text_offset is where its text starts in the echoed choice's text, prompt and generated tokens
    alike, one-shot and streamed (issue 60; SentencePiece's in test_sentencepiece_serving.py)."""
    for prompt in (PROMPT, llm.tokenizer.encode(PROMPT)):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
        c = complete(http, **body)["choices"][0]
        tokens, offsets = c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
        assert "".join(tokens) == c["text"]
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
        events = stream(http, **body)
        assert [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]] == offsets


def test_echo_with_logprobs_scores_the_prompt(http, llm):
    """lm-eval's loglikelihood request: the prompt's logprobs from the prefill, the first one null, equal to the
    engine's own prompt logprobs; max_tokens 0 scores without generating; vLLM's prompt_logprobs shape too."""
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    [ref] = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    want = [t.logprob for t in ref.prompt_logprobs[1:]]
    body = complete(http, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])

    zero = complete(http, prompt=ids, max_tokens=0, logprobs=1, echo=True)
    [choice] = zero["choices"]
    assert choice["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    assert choice["text"] == llm.tokenizer.decode(ids)
    assert choice["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]

    vllm = complete(http, prompt=ids, max_tokens=0, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for token, entry, logprob in zip(ids[1:], vllm[1:], want):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert len(entry) in (2, 3) and min(e["rank"] for e in entry.values()) == 1


def test_a_burst_of_a_thousand_sdk_requests_queues_and_all_succeed(server):
    """Issue 29: 1,000 at once through the SDK (no retries) are queued, not refused, with the served defaults."""

    async def burst():
        # Prompts of 1-3 tokens: the queueing is the point, and "Count {i}:" (6) made the burst 42.8 s against 35.2.
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with openai.AsyncOpenAI(
            base_url=f"{server}/v1",
            api_key="x",
            timeout=600,
            max_retries=0,
            http_client=httpx.AsyncClient(limits=limits, timeout=600),
        ) as sdk:
            return await asyncio.gather(
                *(sdk.completions.create(model=MODEL, prompt=str(i), max_tokens=1, temperature=0) for i in range(1000))
            )

    results = asyncio.run(burst())
    assert len(results) == 1000 and all(r.usage.completion_tokens == 1 for r in results)


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client):
    """usage.prompt_tokens_details.cached_tokens, whole and streamed (issue 29; aiperf reads it)."""
    prompt = "Cache me: " + " ".join(f"word{i}" for i in range(60))  # several 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    chunks = [
        chunk
        for _ in range(2)  # one stream after the other: the second's usage reads the cache
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            n=2,
        )
    ]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_tokenize_detokenize_and_tokenizer_info_use_the_servers_tokenizer(http, llm):
    """vLLM's tokenizer routes: the ids the engine gets for a prompt (BOS as the tokenizer asks) and for chat
    messages (the template), back to text, and the tokenizer's configuration."""
    tok = llm.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    ids = tok.encode(PROMPT, add_special_tokens=True)
    assert (
        r
        == {
            "count": len(ids),
            "max_model_len": r["max_model_len"],
            "tokens": ids,
            "token_strs": [token_text(tok, i) for i in ids],
        }
        and r["max_model_len"] >= 2048
    )
    messages = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages)) and chat["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}
    info = http.get("/tokenizer_info").json()
    assert (info["eos_token_id"], info["vocab_size"]) == (tok.eos_token_id, tok.vocab_size)
    assert info["chat_template"] == tok.chat_template
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/tokenize", {"model": "gpt-4o", "prompt": "a"}, "model"),
    ):
        r = http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_stream_include_usage(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (5, 5, 10)
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])

    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat[-1].choices == [] and 1 <= chat[-1].usage.completion_tokens <= 3
    assert all(c.usage is None for c in chat[:-1])


def test_token_id_prompt(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text
    # A batch of token-id prompts: one choice per prompt.
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.prompt_tokens == len(ids) + 3


# ---------------------------------------------------------------- greedy over HTTP == offline


OFFLINE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "My favourite programming language is",
]


def test_greedy_http_matches_offline_llm(client, llm, tokenizer):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    offline = llm.generate(OFFLINE_PROMPTS, params)

    results = [None] * len(OFFLINE_PROMPTS)

    def one(i):
        results[i] = client.completions.create(
            model=MODEL,
            prompt=OFFLINE_PROMPTS[i],
            max_tokens=16,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(OFFLINE_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, off, r in zip(OFFLINE_PROMPTS, offline, results):
        c = r.choices[0]
        assert r.usage.completion_tokens == len(off.token_ids) == 16, prompt
        assert c.logprobs.tokens == [token_text(tokenizer, t) for t in off.token_ids], prompt
        assert c.text == off.text, prompt
        assert c.finish_reason == off.finish_reason == "length"


# ---------------------------------------------------------------- 64 concurrent streams


def test_64_concurrent_streams(server, http):
    n = 64
    prompts = [f"Fact number {i} about the ocean:" if i % 2 else f"List {i} animals that live in" for i in range(n)]
    max_tokens = [4 + i % 21 for i in range(n)]  # 4..24

    async def run():
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(base_url=server, timeout=300, limits=limits) as ac:

            async def plain(i):
                r = await ac.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prompts[i], "temperature": 0, "max_tokens": max_tokens[i]},
                )
                assert r.status_code == 200, r.text
                return r.json()

            async def streamed(i):
                lines = []
                async with ac.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": prompts[i],
                        "temperature": 0,
                        "max_tokens": max_tokens[i],
                        "stream": True,
                    },
                ) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        lines.append(line)
                return sse_events(lines)

            reference = await asyncio.gather(*(plain(i) for i in range(n)))
            streams = await asyncio.gather(*(streamed(i) for i in range(n)))
            return reference, streams

    before = metrics(http)
    reference, streams = asyncio.run(run())
    for i, (ref, (events, done)) in enumerate(zip(reference, streams)):
        assert done, f"stream {i} did not end with [DONE]"
        assert all("error" not in e for e in events), events
        assert stream_text(events) == ref["choices"][0]["text"], i
        assert finish_reasons(events) == [ref["choices"][0]["finish_reason"]], i
        assert ref["usage"]["completion_tokens"] <= max_tokens[i]

    after = metrics(http)
    count = after["orcinus_iteration_batch_size_count"] - before["orcinus_iteration_batch_size_count"]
    singles = (
        after['orcinus_iteration_batch_size_bucket{le="1.0"}'] - before['orcinus_iteration_batch_size_bucket{le="1.0"}']
    )
    assert count > 0 and singles < count, "no iteration ran more than one request"
    # Most of those iterations ran many requests at once: the batch mean is well above one.
    total = after["orcinus_iteration_batch_size_sum"] - before["orcinus_iteration_batch_size_sum"]
    assert total / count > 8, (total, count)


# ---------------------------------------------------------------- multibyte text


MULTIBYTE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Translate to Chinese: Hello, how are you?"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Give me three happy emoji like 😀."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Translate 'good morning' to Korean."}]}),
    ("/v1/completions", {"prompt": "日本の首都は東京です。中国の首都は"}),
    ("/v1/completions", {"prompt": "Emoji story: 🐶🐱🐭🐹🐰🦊🐻🐼"}),
]


@pytest.mark.parametrize("path,body", MULTIBYTE, ids=["chat-chinese", "chat-emoji", "chat-korean", "cjk", "emoji"])
def test_multibyte_streams_are_never_split(http, path, body):
    body = {**body, "max_tokens": 12, "temperature": 0}
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    full = choice["message"]["content"] if "message" in choice else choice["text"]
    assert "\ufffd" not in full
    assert any(ord(ch) > 0x7F for ch in full), f"no multibyte text generated: {full!r}"

    events = stream(http, path, **body)
    if path.endswith("chat/completions"):
        pieces = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    else:
        pieces = [c["text"] for e in events for c in e["choices"]]
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == full


def test_some_character_spans_several_tokens(http):
    """The multibyte tests mean something: the model emits characters whose bytes straddle tokens."""
    r = complete(http, prompt="Emoji story: 🐶🐱🐭🐹🐰🦊🐻🐼", max_tokens=12, temperature=0, logprobs=0)
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert any(t.startswith("bytes:") for t in tokens), tokens


# ---------------------------------------------------------------- multi-token stop strings


def test_a_stop_string_in_the_last_token_max_tokens_allows_finishes_with_stop(http):
    """The engine ends the sequence at max_tokens, and its last token completes a stop string: the text stops there,
    and so does the reason (one step of accepted drafts can carry a sequence past both at once)."""
    prompt = "Once upon a time, in a small village,"
    base = complete(http, prompt=prompt, max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    text = base["choices"][0]["text"]
    last = base["choices"][0]["logprobs"]["text_offset"][-1]
    start = next((i for i in range(last - 1, -1, -1) if text.find(text[i:]) == i and text[i:].strip()), None)
    assert start is not None, text
    for body in ({}, {"stream": True}):
        if body:
            events = stream(http, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[text[start:]])
            assert stream_text(events) == text[:start] and finish_reasons(events) == ["stop"]
        else:
            r = complete(http, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[text[start:]])
            assert r["choices"][0]["text"] == text[:start] and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("prompt", ["Once upon a time, in a small village,", "def fibonacci(n):"])
def test_multi_token_stop_string_cuts_exactly(http, prompt):
    base = complete(http, prompt=prompt, max_tokens=24, temperature=0, logprobs=0, ignore_eos=True)
    text = base["choices"][0]["text"]
    offsets = base["choices"][0]["logprobs"]["text_offset"]
    # A stop string that starts inside one token and ends inside a later one, first found where we cut it.
    for k in range(len(offsets) // 2, len(offsets) - 1):
        start, end = offsets[k] - 1, offsets[k + 1] + 1
        if offsets[k] - offsets[k - 1] >= 2 and offsets[k + 1] - offsets[k] >= 1 and end < offsets[-1]:
            stop = text[start:end]
            if text.find(stop) == start and stop.strip():
                break
    else:
        pytest.fail(f"no usable stop string in {text!r}")
    assert len(stop) >= 3
    expected = text[:start]

    r = complete(http, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert r["choices"][0]["text"] == expected
    assert r["choices"][0]["finish_reason"] == "stop"

    events = stream(http, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=["never-here", stop])
    got = stream_text(events)
    assert got == expected, (got, expected, stop)
    assert finish_reasons(events) == ["stop"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # nothing follows the stop

    # The same through the chat route, the stop given as a plain string.
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json={"model": MODEL, **chat})
    chat_text = r.json()["choices"][0]["message"]["content"]
    start = next(
        i
        for i in range(3, len(chat_text) - 8)
        if chat_text.find(chat_text[i : i + 5]) == i and chat_text[i : i + 5].strip()
    )
    cstop = chat_text[start : start + 5]
    cut = stream(http, "/v1/chat/completions", **chat, stop=cstop)
    assert "".join(c["delta"].get("content") or "" for e in cut for c in e["choices"]) == chat_text[:start]
    assert [c["finish_reason"] for e in cut for c in e["choices"] if c["finish_reason"]] == ["stop"]
    r = http.post("/v1/chat/completions", json={"model": MODEL, **chat, "stop": cstop})
    assert r.json()["choices"][0]["message"]["content"] == chat_text[:start]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_a_stop_token_ids_text_is_not_in_the_choice(http, tokenizer):
    """A stop token id ends the text before its own text, though it counts and has its logprob (vLLM's behaviour;
    here "." or the like, not a special token that would be skipped anyway), streamed or not."""
    prompt = "The capital of France is"
    base = complete(http, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)["choices"][0]
    tokens, offsets = base["logprobs"]["tokens"], base["logprobs"]["text_offset"]
    k = next(i for i in range(1, len(tokens)) if tokens[i].strip() and tokens[i] not in tokens[:i])
    (stop_id,) = tokenizer.encode(tokens[k])
    cut = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    r = complete(http, **cut, stop_token_ids=[stop_id])
    choice = r["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (base["text"][: offsets[k]], "stop")
    assert choice["logprobs"]["tokens"] == tokens[: k + 1] and r["usage"]["completion_tokens"] == k + 1
    events = stream(http, **cut, stop_token_ids=[stop_id])
    assert stream_text(events) == base["text"][: offsets[k]] and finish_reasons(events) == ["stop"]


def test_no_stop_string_ends_a_choice_before_min_tokens(http):
    """vLLM's behaviour: with min_tokens 2, the first token's text as a stop string ends the text only where it
    occurs again later, streamed or not."""
    prompt = "The capital of France is"
    cut = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    base = complete(http, **cut, logprobs=0)["choices"][0]
    text, offsets = base["text"], base["logprobs"]["text_offset"]
    first = text[: offsets[1]]
    later = text.find(first, offsets[1])
    expected = (text[:later], "stop") if later >= 0 else (text, "length")
    c = complete(http, **cut, stop=[first], min_tokens=2)["choices"][0]
    assert (c["text"], c["finish_reason"]) == expected
    events = stream(http, **cut, stop=[first], min_tokens=2)
    assert (stream_text(events), *finish_reasons(events)) == expected


# ---------------------------------------------------------------- disconnects free the KV cache


LONG = {
    "model": MODEL,
    "prompt": "Write a very long story about a dragon.",
    "max_tokens": 4000,
    "temperature": 0,
    "ignore_eos": True,
}


def test_streaming_disconnect_frees_kv_blocks(server, http):
    baseline = wait_idle(http)["orcinus_kv_blocks_used"]
    with (
        httpx.Client(base_url=server, timeout=60) as c,
        c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                got += 1
                if got == 3:
                    break
        busy = metrics(http)
        assert busy["orcinus_requests_running"] == 1
        assert busy["orcinus_kv_blocks_used"] > baseline
        # leaving both blocks closes the connection mid-stream
    wait_for(
        http,
        lambda m: m["orcinus_requests_running"] == 0 and m["orcinus_kv_blocks_used"] == baseline,
        10,
        "the aborted stream's KV blocks were not freed",
    )
    time.sleep(1.0)
    m = metrics(http)
    assert m["orcinus_kv_blocks_used"] == baseline and m["orcinus_requests_running"] == 0


def test_non_streaming_client_timeout_frees_kv_blocks(server, http):
    baseline = wait_idle(http)["orcinus_kv_blocks_used"]
    outcome = {}

    def request():
        try:
            httpx.post(f"{server}/v1/completions", json=LONG, timeout=httpx.Timeout(4.0))
            outcome["result"] = "answered"
        except httpx.TimeoutException:
            outcome["result"] = "timed out"

    t = threading.Thread(target=request)
    t.start()
    wait_for(
        http,
        lambda m: m["orcinus_requests_running"] == 1 and m["orcinus_kv_blocks_used"] > baseline,
        10,
        "the long request never ran",
    )
    t.join(30)
    assert outcome.get("result") == "timed out"
    m = wait_for(
        http,
        lambda m: m["orcinus_requests_running"] == 0 and m["orcinus_kv_blocks_used"] == baseline,
        10,
        "the abandoned request's KV blocks were not freed",
    )
    generated = m["orcinus_generation_tokens_total"]
    time.sleep(1.0)
    assert metrics(http)["orcinus_generation_tokens_total"] == generated  # the engine really stopped


def test_server_still_serves_after_disconnects(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text


def test_metrics_exposition(http):
    text = http.get("/metrics").text
    for name in (
        "orcinus_kv_blocks_used",
        "orcinus_kv_blocks_free",
        "orcinus_requests_running",
        "orcinus_requests_waiting",
        "orcinus_iteration_batch_size_bucket",
        "orcinus_generation_tokens_total",
        "orcinus_time_to_first_token_seconds_count",
        "orcinus_inter_token_latency_seconds_count",
    ):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? ", text, re.MULTILINE), name


def test_request_histograms_move_with_a_request(http):
    """vLLM-style per-request histograms (issue 29 item 7): one finished 3-token request adds one observation to
    each, with its token counts in the sums."""
    names = (
        "orcinus_e2e_request_latency_seconds",
        "orcinus_request_queue_time_seconds",
        "orcinus_request_prompt_tokens",
        "orcinus_request_generation_tokens",
    )
    before = parse_metrics(http.get("/metrics").text)
    body = complete(http, prompt=[1, 2, 3, 4, 5], max_tokens=3, temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 3
    after = parse_metrics(http.get("/metrics").text)
    for name in names:
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0) >= 1, name
    # Other tests may run beside this one on the session server: only a lower bound on the sums.
    assert after["orcinus_request_prompt_tokens_sum"] - before.get("orcinus_request_prompt_tokens_sum", 0) >= 5
    assert after["orcinus_request_generation_tokens_sum"] - before.get("orcinus_request_generation_tokens_sum", 0) >= 3
    # The Grafana dashboard shipped in docs/ reads only series the server exports.
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exported = {key.split("{")[0] for key in after}
    for name in set(re.findall(r"orcinus_\w+", " ".join(exprs))):
        assert name in exported, name
