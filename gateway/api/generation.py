"""Run the choices of one API request in the engine and turn their token deltas into text events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from engine.core.request import NO_OPTIONS, EngineRequest, RequestOptions, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.ipc.messages import PromptLogprobsPart, TokenDelta
from gateway.api.detokenizer import IncrementalDetokenizer
from gateway.engines.replicas import Replicas
from gateway.web.in_flight import Ticket
from gateway.web.metrics import Metrics


@dataclass
class ChoiceEvent:
    """New text of one choice; `logprobs` has one per new token where the request asked for them."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    token_offsets: list[int]  # where each new token's text starts in the choice's text
    finish_reason: str | None
    # On a choice's first event when the request asked for them: one for each prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled prompt, on its one event


@dataclass
class _Choice:
    index: int
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    started: float
    last_token_at: float | None = None
    num_tokens: int = 0
    finished: bool = False
    offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # PromptLogprobsParts' rows, gathered before the first token
    num_cached_tokens: int = 0  # of its prompt, found in the engine's prefix cache


class _Deltas(asyncio.Queue):
    """A request's deltas as the engine sends them. A sequence's admission is given back the moment its last delta
    (or its error) arrives, whether or not the client has read it: a client that stops reading holds no slot once
    the engine is done (what waits here is bounded by max_tokens; the send timeout drops the connection)."""

    def __init__(self, finished: Callable[[str], None]):
        super().__init__()
        self._sequence_done = finished

    def put_nowait(self, item) -> None:
        request_id, msg = item
        if request_id is not None and (
            isinstance(msg, Exception) or (isinstance(msg, TokenDelta) and msg.finish_reason is not None)
        ):
            self._sequence_done(request_id)
        super().put_nowait(item)


@dataclass(eq=False)  # compared (and hashed, in the server's set of live ones) by identity
class Generation:
    """Every choice of a request: `prompts` x `n`, choice index = prompt index * n + i."""

    client: Replicas
    metrics: Metrics
    tokenizer: object
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stop: list[str]
    ticket: Ticket  # the admitted sequences; one is given back as each choice ends
    options: RequestOptions = NO_OPTIONS  # every choice's (its cache salt, priority, ...)
    prompt_only: bool = False  # max_tokens 0: the engine's one sampled token is dropped, the choice ends "length"
    choices: dict[str, _Choice] = field(default_factory=dict)
    _released: set[str] = field(default_factory=set, repr=False)  # sequences whose admission was given back
    _queue: asyncio.Queue | None = field(default=None, repr=False)  # events() reads its deltas here

    @property
    def num_prompt_tokens(self) -> int:
        """Each prompt counts once, however many choices it has (as OpenAI's and vLLM's usage)."""
        return sum(len(p) for p in self.prompts)

    @property
    def token_counts(self) -> tuple[int, int, int]:
        """Prompt, completion and cached prompt tokens so far: what usage reports."""
        return self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each prompt once: its least-cached choice's (siblings find the
        blocks the first one computed)."""
        per_prompt: dict[int, int] = {}
        for c in self.choices.values():
            p = c.index // self.n
            per_prompt[p] = min(per_prompt.get(p, c.num_cached_tokens), c.num_cached_tokens)
        return sum(per_prompt.values())

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Yield events as tokens arrive; closing the iterator early aborts every unfinished choice."""
        queue = self._queue = _Deltas(self._release)
        base = uuid.uuid4().hex
        grammar_id = None  # the grammar goes to the engine once, however many sequences it constrains
        try:
            shared = self.params
            if shared.grammar is not None:
                grammar_id = base
                await self.client.add_grammar(grammar_id, shared.grammar)
                shared = msgspec.structs.replace(shared, grammar=None)
            for p, prompt in enumerate(self.prompts):
                for i in range(self.n):
                    index = p * self.n + i
                    params = shared
                    if self.n > 1 and params.seed is not None:  # distinct yet reproducible choices
                        params = msgspec.structs.replace(params, seed=params.seed + i)
                    rid = f"{base}-{index}"
                    self.choices[rid] = _Choice(
                        index,
                        len(prompt),
                        IncrementalDetokenizer(self.tokenizer, self.stop, min_tokens=params.min_tokens),
                        time.monotonic(),
                    )
                    self.metrics.prompt_tokens.inc(len(prompt))
                    await self.client.add(EngineRequest(rid, prompt, params, self.options), queue, grammar_id)
            if grammar_id is not None:
                self.client.release_grammar(grammar_id)
                grammar_id = None
            pending = len(self.choices)
            while pending:
                rid, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                choice = self.choices[rid]
                if choice.finished:
                    continue  # a delta already in flight when a stop string ended this choice
                if isinstance(item, PromptLogprobsPart):
                    choice.prompt_logprobs += item.logprobs
                    continue
                event = self._advance(rid, choice, item)
                if event.finish_reason is not None:
                    pending -= 1
                yield event
        finally:
            if grammar_id is not None:  # sending stopped part-way
                self.client.release_grammar(grammar_id)
            for rid, choice in self.choices.items():
                if not choice.finished:
                    self.client.abort(rid)
                    self.metrics.aborted.inc()
                else:
                    self.client.release(rid)
            self.close()

    def fail(self, error: Exception) -> None:
        """End `events()` with `error` (its unfinished choices are then aborted), e.g. at the shutdown deadline."""
        if self._queue is not None:
            self._queue.put_nowait((None, error))

    def close(self) -> None:
        """Give back every admitted sequence not yet given back (idempotent)."""
        self.ticket.close()

    def _release(self, request_id: str) -> None:
        if request_id not in self._released:
            self._released.add(request_id)
            self.ticket.release()

    def _advance(self, rid: str, choice: _Choice, delta: TokenDelta) -> ChoiceEvent:
        now = time.monotonic()
        if choice.last_token_at is None:
            self.metrics.ttft.observe(now - choice.started)
        else:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        if delta.num_cached_tokens is not None:
            choice.num_cached_tokens = delta.num_cached_tokens
        if delta.queue_seconds is not None:
            self.metrics.queue_time.observe(delta.queue_seconds)
        prompt = None
        if self.params.prompt_logprobs is not None and choice.num_tokens == 0:
            prompt, choice.prompt_logprobs = choice.prompt_logprobs, []
        if self.prompt_only:
            if delta.finish_reason is None:
                self.client.abort(rid)
            choice.finished = True
            self._release(rid)
            self.metrics.finished.labels("length").inc()
            return ChoiceEvent(choice.index, "", [], [], [], "length", prompt, delta.embedding)
        detok = choice.detok
        first = detok.num_tokens
        # The engine's "stop" is its eos or a stop token id: the delta's last token.
        text = detok.push(delta.token_ids, ends_with_stop_token=delta.finish_reason == "stop")
        offsets = detok.token_offsets[first:]
        # A delta of several tokens (a step that accepted draft tokens) may hold a stop string's end: the detokenizer
        # stopped there, and the tokens after it are not the choice's.
        token_ids, logprobs = delta.token_ids[: len(offsets)], (delta.logprobs or [])[: len(offsets)]
        choice.num_tokens += len(token_ids)
        self.metrics.generation_tokens.inc(len(token_ids))
        finish = delta.finish_reason
        if detok.stopped and finish in (None, "length"):
            # A stop string ended the text, even where the same step also reached max_tokens (a step's drafts can
            # carry a sequence past both): OpenAI reports "stop".
            if finish is None:
                self.client.abort(rid)  # the engine does not know stop strings: free its blocks now
            finish = "stop"
        if finish is not None:
            text += detok.flush()
            choice.finished = True
            self._release(rid)
            self.metrics.finished.labels(finish).inc()
            self.metrics.e2e.observe(now - choice.started)
            self.metrics.request_prompt_tokens.observe(choice.num_prompt_tokens)
            self.metrics.request_generation_tokens.observe(choice.num_tokens)
        return ChoiceEvent(choice.index, text, token_ids, logprobs, offsets, finish, prompt)
