"""Locust users streaming `/v1/completions` and `/v1/chat/completions` from any OpenAI-compatible server.

Besides the per-request rows, two custom rows show in the web UI and the CSV: `TTFT` (time to
first token, ms) and `tokens/s` (its "response time" column is the stream's output tokens per second).
A non-200 status, an error event or a stream without `[DONE]` is a failure.

    locust -f bench/serving/locustfile.py --host http://127.0.0.1:8000
    locust -f bench/serving/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 60s --csv out

A server started with an API key needs it: set ORCINUS_API_KEY (as for the README's examples).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("ORCINUS_MODEL", "SmolLM2-135M-Instruct")  # what to put in the `model` field
API_KEY = os.environ.get("ORCINUS_API_KEY")  # sent as `Authorization: Bearer ...` when set

SUBJECTS = [
    "the ocean",
    "a lighthouse keeper",
    "bread",
    "the moon landing",
    "a chess game",
    "autumn",
    "a robot",
    "volcanoes",
    "a city at night",
    "honeybees",
    "the printing press",
    "a long train ride",
]
FORMS = [
    "Write a short poem about {}.",
    "Explain {} to a child.",
    "List three facts about {}.",
    "Tell a very short story about {}.",
    "Describe {} in one paragraph.",
]


def _prompt(rng: random.Random) -> str:
    return rng.choice(FORMS).format(rng.choice(SUBJECTS))


class OpenAIStreamingUser(HttpUser):
    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random()
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    @task(2)
    def completion(self) -> None:
        body = {
            "model": MODEL,
            "prompt": _prompt(self.rng),
            "max_tokens": self.rng.randint(8, 48),
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._stream("/v1/completions", body)

    @task(1)
    def chat(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": _prompt(self.rng)}],
            "max_tokens": self.rng.randint(8, 48),
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._stream("/v1/chat/completions", body)

    def _stream(self, path: str, body: dict) -> None:
        start = time.perf_counter()
        first = None
        tokens = 0
        done = False
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                for raw in resp.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        resp.failure(f"error event: {event['error'].get('message')}")
                        return
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and first is None:
                        first = time.perf_counter()
            except Exception as e:  # a broken stream is a failure, not a crash of the user
                resp.failure(f"broken stream: {type(e).__name__}: {e}")
                return
            if not done:
                resp.failure("stream ended without [DONE]")
                return
            resp.success()
        end = time.perf_counter()
        fire = self.environment.events.request.fire
        if first is not None:
            fire(
                request_type="METRIC",
                name="TTFT",
                response_time=(first - start) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        if tokens and end > start:
            fire(
                request_type="METRIC",
                name="tokens/s",
                response_time=tokens / (end - start),
                response_length=tokens,
                exception=None,
                context={},
            )
