"""A request's state inside the engine: its tokens, counters and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import msgspec

from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted and waiting to recompute
    RUNNING = "running"  # admitted: holds KV blocks and is scheduled every iteration
    FINISHED_STOPPED = "stop"  # hit eos or a stop token id
    FINISHED_LENGTH = "length"  # hit max_tokens or the context window
    FINISHED_ABORTED = "abort"  # cancelled by its client
    FINISHED_ERROR = "error"  # its batch's forward pass, or its own sampling, raised (Request.error says what)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True)
class Failure:
    """In place of a request's sampled token: what raised while its batch ran or while it sampled."""

    message: str


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprob of the chosen token and the top-N alternatives at one position: one type from the sampler to the
    gateway (it crosses the stage and engine frames as it is)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's place in the distribution (1: the most likely); given for prompt tokens


class SampledTokens(msgspec.Struct, array_like=True):
    """A request's tokens from one step: the draft tokens the target accepted, then the one it sampled after them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token, where the request asked for logprobs
    hidden: list[float] | None = None  # the final hidden state at its last known token, where the step probed it
    embedding: list[float] | None = None  # its prompt's pooled final hidden states (params.pooling), unnormalised


class RequestOptions(msgspec.Struct, frozen=True, array_like=True):
    """What a caller asks of the engine besides a prompt and its sampling: the same for every choice of an API
    request, read by the engine where it applies (a new option is a field here, set by the caller, read by its user)."""

    cache_salt: bytes = b""  # opaque; mixed into its first block's name: only requests with the same salt share blocks
    priority: int = 0  # lower is admitted first under the `priority` scheduling policy
    lora: str = ""  # the LoRA adapter it runs under, by name; "": the base model


NO_OPTIONS = RequestOptions()


class EngineRequest(msgspec.Struct, frozen=True, array_like=True):
    """One sequence to generate, built once by its caller (the gateway, per choice; LLM.generate) and taken as it is
    by EngineCore.add_request, across the engine frame (AddRequest) where there is one. Request is the engine's
    own state of it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: RequestOptions = NO_OPTIONS


@dataclass(eq=False)
class Request:
    """One generation: the scheduler catches `num_computed_tokens` up to `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None  # None when the caller asked to ignore eos
    options: RequestOptions = NO_OPTIONS  # as its caller sent them
    lora_id: int = 0  # its adapter's id in the engine's LoRA pool (0: the base model); names its prefix-cache blocks
    arrival_order: int = 0  # its place among the scheduler's arrivals (numbered as they are added)
    length: object | None = None  # its probes and predictions (core/queue_policy.py's LengthState), where probed
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Logprobs of prompt tokens 1, 2, ... (as params.prompt_logprobs asks), each computed by its prefill chunk.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_logprob_rows: int = 0  # prompt positions whose row of logprobs is scheduled (computed or in flight)
    embedding: list[float] | None = None  # with params.pooling: the pooled prompt, once its last chunk ran
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_in_flight_tokens: int = 0  # tokens in batches submitted but not yet updated (computed, or being)
    num_pending_outputs: int = 0  # tokens being sampled in those batches: the host learns them at update
    block_table: list[int] = field(default_factory=list)  # KV block ids, in order
    block_names: list[bytes] = field(default_factory=list)  # prefix-cache names of its full blocks (from its tokens)
    num_registered_blocks: int = 0  # leading blocks of block_table the prefix cache knows
    num_released_blocks: int = 0  # leading blocks of block_table given back: before every layer's sliding window
    num_sent_blocks: int = 0  # leading blocks of block_table that batches carried to the runners, which keep them
    num_sent_tokens: int = -1  # where the runners place its next decode row unless told (-1: they cannot know)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission (usage reports them)
    queue_seconds: float | None = None  # from arrival to its first admission (the queue-time histogram)
    matcher: object | None = (
        None  # a constrained request's llguidance matcher, compiled by the engine process for its sampler
    )
    speculation: object | None = None  # its drafter and acceptance estimate (core/speculation.py), from its first draft
    num_delivered_tokens: int = 0  # outputs already handed to its caller (the engine process's deltas)
    # Outputs at which it ends for length: max_tokens or the context window, whichever comes first (Scheduler.add
    # sets it; 0: every token takes the scheduler's general stop check).
    output_limit: int = 0
    error: str | None = None  # why it failed (status FINISHED_ERROR)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        # Read several times per request per step: two len()s, not two more properties.
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Where the next chunk starts: tokens computed plus those already in a batch in flight."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def reads_own_outputs(self) -> bool:
        """Whether sampling its next token needs every earlier output on the host (penalties, a grammar, min_tokens
        still masking eos): such a request is never scheduled ahead of a token it has yet to see."""
        return self.samples_from_outputs or len(self.output_token_ids) < self.params.min_tokens

    @cached_property  # params are frozen: asked per running request per step, computed once
    def samples_from_outputs(self) -> bool:
        """Whether every token's sampling reads the outputs before it: penalties, a grammar."""
        return self.params.has_penalties or self.params.grammar is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and are not all computed: its prompt must run through the model,
        so it takes nothing from the prefix cache (a cached block holds K/V, not the logits its positions need)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprob_rows < self.num_prompt_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole history."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request can ever hold: its prompt plus max_tokens (none for a prompt-only request)."""
        return self.num_prompt_tokens + self.params.output_room

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @cached_property  # params are frozen and eos is fixed at creation: compute once, read every token
    def stop_token_ids(self) -> frozenset[int]:
        ids = set(self.params.stop_token_ids)
        if self.eos_token_id is not None and not self.params.ignore_eos:
            ids.add(self.eos_token_id)
        return frozenset(ids)
