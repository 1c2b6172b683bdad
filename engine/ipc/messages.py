"""Frames between the gateway and the engine process (msgspec, never pickle)."""

from __future__ import annotations

import msgspec

from engine.core.request import EngineRequest, TokenLogprobs
from engine.core.request_limits import RequestLimits

# ---------------------------------------------------------------- gateway -> engine


class AddGrammar(msgspec.Struct, tag=True, array_like=True):
    """A grammar the AddRequests after it name by `grammar_id`: sent once, however many sequences it constrains."""

    grammar_id: str
    grammar: str


class ReleaseGrammar(msgspec.Struct, tag=True, array_like=True):
    """No further AddRequest names this grammar (those sent keep their own copies of its matcher)."""

    grammar_id: str


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A request for EngineCore.add_request, as the gateway built it."""

    request: EngineRequest  # its params' `grammar` unset when `grammar_id` names one
    grammar_id: str | None = None  # an AddGrammar sent before: the request waits until it has compiled


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class LoadLora(msgspec.Struct, tag=True, array_like=True):
    """Serve the LoRA adapter at `path` as `name`; answered by a LoraResult of the same `op_id` (0: unanswered)."""

    op_id: int
    name: str
    path: str


class UnloadLora(msgspec.Struct, tag=True, array_like=True):
    """Stop serving adapter `name` (requests running under it finish); answered by a LoraResult."""

    op_id: int
    name: str


# ---------------------------------------------------------------- engine -> gateway


class EngineSummary(msgspec.Struct, frozen=True, array_like=True):
    """What the engine resolved and sized at startup, for the server's startup log."""

    device: str  # the torch device the model runs on
    dtype: str
    num_params: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    pipeline_stages: int
    tensor_parallel_size: int = 1
    kernels: str = ""  # what the executor built (attention, linear layers, token ops, graphs); "" when not known
    cpp_ops: str = (
        ""  # where the engine's C++ ops came from (prebuilt by the install, or built at run time); "" if none
    )
    kv_cache_dtype: str = ""  # what the KV cache stores and why ("float16, as asked"); "" when not known
    defaults: tuple[str, ...] = ()  # each setting an `auto` rule decides: "threads 2 (as asked)"; () when not known


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    """Sent once the model is loaded: what the gateway needs to validate requests without asking."""

    model_name: str
    limits: RequestLimits
    summary: EngineSummary


class TokenDelta(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # None while the request runs
    logprobs: list[TokenLogprobs] | None = None  # one per token, where the request asked for them
    num_cached_tokens: int | None = None  # on a request's first delta: its prompt tokens found in the prefix cache
    queue_seconds: float | None = None  # on a request's first delta: how long it waited for admission
    embedding: list[float] | None = None  # on an embedding request's last delta: its pooled prompt (unnormalised)


class StepDeltas(msgspec.Struct, tag=True, array_like=True):
    """Every request's TokenDelta from one step, in one frame: one ring write and one doorbell per step, however
    many requests decode. A step whose deltas carry many logprobs is split over several frames (the ring bounds one).
    """

    deltas: list[TokenDelta]
    # The step's plain deltas as columns, after `deltas`: one token each for a running request that has had its first
    # delta and asked for no logprobs (what most decode steps give most requests).
    request_ids: list[str] = []
    token_ids: list[int] = []


class PromptLogprobsPart(msgspec.Struct, tag=True, array_like=True):
    """Prompt logprobs of a request that asked for them, sent in parts before its first TokenDelta (a long prompt's
    would not fit in one frame): positions start, start + 1, ... (position 0, the first token, has none)."""

    request_id: str
    start: int
    logprobs: list[TokenLogprobs]  # with their ranks


class RequestError(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str
    param: str | None = None
    internal: bool = False  # the engine failed it (a 500), rather than the request being invalid (a 400)
    not_found: bool = False  # it names a model (a LoRA adapter) the engine does not serve: a 404


class LoraResult(msgspec.Struct, tag=True, array_like=True):
    """How a LoadLora or UnloadLora went: `error` None when it did."""

    op_id: int
    error: str | None = None
    not_found: bool = False  # the error is that no adapter of that name is loaded


class EngineStats(msgspec.Struct, tag=True, array_like=True):
    """Sent after every iteration (and about once a second when idle)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_iterations: int
    last_batch_size: int  # requests in the last iteration
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    last_batch_tokens: int = 0  # tokens in the last iteration
    last_iteration_seconds: float = 0.0  # 0 when this report follows no iteration
    rss_bytes: int = 0  # the engine process's resident memory; 0 when unknown
    prefix_queried_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of those, found there
    kv_blocks_cached: int = 0  # blocks whose contents the prefix cache can find
    private_bytes: int = 0  # rss_bytes less the shared-memory pages (the channel rings) in it; 0 when unknown
    spec_draft_tokens_total: int = 0  # draft tokens verified since start (speculative decoding)
    spec_accepted_tokens_total: int = 0  # of those, accepted
    spec_accepted_lengths: list[int] = []  # per draft verified since the last report: its tokens accepted
    # per request finished since the last report whose length was predicted: (prediction / real length, its pool
    # "short" or "long", seconds it waited for admission)
    length_outcomes: list[tuple[float, str, float]] = []
    spec_row_cost: float = 0.0  # a row's cost as speculation measures it; 0 without speculation
    step_paths: dict[str, int] = {}  # steps since start by how they ran: whole-step graph, piecewise graphs, eager


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """The engine process answers: sent by a thread of its own, whatever its step loop is doing (a long step sends
    nothing else), so the gateway tells a stopped process from a busy one."""


class CacheEvents(msgspec.Struct, tag=True, array_like=True):
    """Prefix-cache blocks named and evicted in a step, as routing keys (`cache_key` of their names), in order: what
    a cache-aware router needs to know which replica holds which prefix. Sent only where the gateway asks."""

    stored: list[int]
    removed: list[int]


def cache_key(name: bytes) -> int:
    """A block name's first 8 bytes: a routing hint, not an identity (a collision misroutes, it corrupts nothing)."""
    return int.from_bytes(name[:8], "little", signed=True)


ToEngine = AddGrammar | ReleaseGrammar | AddRequest | Abort | Shutdown | LoadLora | UnloadLora
FromEngine = (
    EngineReady | PromptLogprobsPart | StepDeltas | RequestError | EngineStats | CacheEvents | Heartbeat | LoraResult
)
