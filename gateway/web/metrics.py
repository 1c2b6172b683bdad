"""Prometheus metrics of the gateway and, from its stats frames, of the engine."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from engine.ipc.memory import this_process
from engine.ipc.messages import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_RATIO_BUCKETS = (0.125, 0.25, 0.5, 0.8, 1.25, 2.0, 4.0, 8.0)  # predicted over real: 1 is exact
REPLICA = ["replica"]  # the label of what a data-parallel replica's engine reports (0 for the only one)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _private_bytes() -> int:
    memory = this_process()
    return memory.private_bytes if memory else 0


class Metrics:
    """One registry per server (no process-global state)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # the gateway's own process_resident_memory_bytes, cpu, fds
        self.running = Gauge("orcinus_requests_running", "Requests the engine is running", REPLICA, registry=r)
        self.waiting = Gauge("orcinus_requests_waiting", "Requests waiting for admission", REPLICA, registry=r)
        self.kv_used = Gauge("orcinus_kv_blocks_used", "KV cache blocks held by requests", REPLICA, registry=r)
        self.kv_free = Gauge(
            "orcinus_kv_blocks_free", "KV cache blocks nobody holds (cached ones included)", REPLICA, registry=r
        )
        self.preemptions = Gauge("orcinus_preemptions", "Preemptions since start", REPLICA, registry=r)
        self.prefix_queried = Gauge(
            "orcinus_prefix_cache_queried_tokens",
            "Tokens of admitted requests looked up in the prefix cache since start",
            REPLICA,
            registry=r,
        )
        self.prefix_hits = Gauge(
            "orcinus_prefix_cache_hit_tokens", "Tokens found in the prefix cache since start", REPLICA, registry=r
        )
        self.kv_cached = Gauge(
            "orcinus_kv_blocks_cached", "KV cache blocks the prefix cache can find (held or free)", REPLICA, registry=r
        )
        self.iterations = Gauge("orcinus_iterations", "Engine iterations since start", REPLICA, registry=r)
        self.step_paths = Gauge(
            "orcinus_steps_by_path",
            "Forward passes since start by how they ran: whole-step graph, piecewise graphs or eager",
            ["path", *REPLICA],
            registry=r,
        )
        self.engine_rss = Gauge(
            "orcinus_engine_resident_memory_bytes", "Resident memory of the engine process", REPLICA, registry=r
        )
        # Resident memory less the channel rings' shared pages, which count in RSS once touched (engine/ipc/memory.py).
        self.engine_private = Gauge(
            "orcinus_engine_private_memory_bytes",
            "Resident memory of the engine process, shared-memory pages excluded",
            REPLICA,
            registry=r,
        )
        self.gateway_private = Gauge(
            "orcinus_gateway_private_memory_bytes",
            "Resident memory of the gateway process, shared-memory pages excluded",
            registry=r,
        )
        self.gateway_private.set_function(_private_bytes)
        self.in_flight = Gauge(
            "orcinus_sequences_in_flight", "Sequences sent to the engine and not finished", registry=r
        )
        self.admitted = Gauge(
            "orcinus_sequences_admitted", "Deprecated: use orcinus_sequences_in_flight (the same gauge)", registry=r
        )
        self.rejected = Counter("orcinus_requests_rejected", "Requests refused with 429 at capacity", registry=r)
        self.requests = Counter(
            "orcinus_requests",
            "Requests admitted, by the model they run under: the base model's name or a LoRA adapter's",
            ["model"],
            registry=r,
        )
        self.routed = Counter(
            "orcinus_routed_requests",
            "Sequences sent to each replica, by why: the prompt's prefix "
            "cached there (cache), the fewest tokens in flight (load), the loads out of balance "
            "(balance), its LoRA adapter resident there (lora), or its turn",
            ["replica", "reason"],
            registry=r,
        )
        self.healthy = Gauge(
            "orcinus_engine_healthy",
            "1 while the replica takes requests: its engine is running, ready and answering",
            REPLICA,
            registry=r,
        )
        self.rerouted = Counter(
            "orcinus_rerouted_requests",
            "Sequences moved off a replica before their first token, by why: its engine exited or stopped answering",
            ["replica", "reason"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "orcinus_engine_restarts", "Engine processes restarted after dying", REPLICA, registry=r
        )
        self.prompt_tokens = Counter("orcinus_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("orcinus_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("orcinus_requests_finished", "Finished sequences", ["finish_reason"], registry=r)
        self.failed = Counter(
            "orcinus_requests_failed",
            "Sequences the engine failed (its batch's forward pass or "
            "its own sampling raised); the engine went on with the others",
            registry=r,
        )
        self.aborted = Counter(
            "orcinus_requests_aborted",
            "Sequences ended before they finished: the client left, stopped the stream or timed out",
            registry=r,
        )
        self.ttft = Histogram(
            "orcinus_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "orcinus_inter_token_latency_seconds", "Time between tokens", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "orcinus_e2e_request_latency_seconds",
            "From arrival to the last token, per sequence",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            "orcinus_request_queue_time_seconds",
            "Time waiting for the engine's admission",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = Histogram(
            "orcinus_request_prompt_tokens", "Prompt tokens per sequence", registry=r, buckets=_TOKEN_BUCKETS
        )
        self.request_generation_tokens = Histogram(
            "orcinus_request_generation_tokens",
            "Generated tokens per finished sequence",
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.iteration_seconds = Histogram(
            "orcinus_iteration_seconds", "Engine iteration time", REPLICA, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.batch_size = Histogram(
            "orcinus_iteration_batch_size", "Requests per engine iteration", REPLICA, registry=r, buckets=_BATCH_BUCKETS
        )
        self.spec_drafted = Gauge(
            "orcinus_spec_decode_draft_tokens", "Draft tokens verified since start", REPLICA, registry=r
        )
        self.spec_accepted = Gauge(
            "orcinus_spec_decode_accepted_tokens", "Draft tokens accepted since start", REPLICA, registry=r
        )
        self.spec_accepted_length = Histogram(
            "orcinus_spec_decode_accepted_length",
            "Draft tokens accepted per request per step that drafted",
            REPLICA,
            registry=r,
            buckets=_DRAFT_BUCKETS,
        )
        self.spec_row_cost = Gauge(
            "orcinus_spec_decode_row_cost",
            "One more row's cost as a share of a step's fixed cost, as speculation measures it",
            REPLICA,
            registry=r,
        )
        self.length_prediction = Histogram(
            "orcinus_length_prediction_ratio",
            "A finished request's output length predicted from its prompt over its "
            "real length (--scheduling-policy predicted)",
            REPLICA,
            registry=r,
            buckets=_RATIO_BUCKETS,
        )
        self.queue_time_by_pool = Histogram(
            "orcinus_request_queue_time_by_pool_seconds",
            "Time waiting for admission, by predicted length (short: < 64 tokens)",
            ["pool", "replica"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )

    def add_replica(self, index: int, healthy: Callable[[], bool]) -> None:
        """Show replica `index`'s engine series (at zero) before its first report; `healthy` is asked at each scrape."""
        label = str(index)
        self.healthy.labels(label).set_function(lambda: float(healthy()))
        for metric in (
            self.running,
            self.waiting,
            self.kv_used,
            self.kv_free,
            self.preemptions,
            self.prefix_queried,
            self.prefix_hits,
            self.kv_cached,
            self.iterations,
            self.engine_restarts,
            self.spec_drafted,
            self.spec_accepted,
        ):
            metric.labels(label)

    def add_model(self, name: str) -> None:
        """Show `name`'s series of orcinus_requests (at zero) before its first request: the base model, an adapter."""
        self.requests.labels(name)

    def observe_stats(self, s: EngineStats, replica: int = 0) -> None:
        label = str(replica)
        self.running.labels(label).set(s.num_running)
        self.waiting.labels(label).set(s.num_waiting)
        self.kv_used.labels(label).set(s.kv_blocks_used)
        self.kv_free.labels(label).set(s.kv_blocks_free)
        self.preemptions.labels(label).set(s.num_preemptions)
        self.prefix_queried.labels(label).set(s.prefix_queried_tokens)
        self.prefix_hits.labels(label).set(s.prefix_hit_tokens)
        self.kv_cached.labels(label).set(s.kv_blocks_cached)
        self.iterations.labels(label).set(s.num_iterations)
        for path, n in s.step_paths.items():
            self.step_paths.labels(path, label).set(n)
        if s.rss_bytes:
            self.engine_rss.labels(label).set(s.rss_bytes)
            self.engine_private.labels(label).set(s.private_bytes)
        if s.last_iteration_seconds > 0:
            self.iteration_seconds.labels(label).observe(s.last_iteration_seconds)
            self.batch_size.labels(label).observe(s.last_batch_size)
        self.spec_drafted.labels(label).set(s.spec_draft_tokens_total)
        self.spec_accepted.labels(label).set(s.spec_accepted_tokens_total)
        if s.spec_row_cost:
            self.spec_row_cost.labels(label).set(s.spec_row_cost)
        for n in s.spec_accepted_lengths:
            self.spec_accepted_length.labels(label).observe(n)
        for ratio, pool, queue_seconds in s.length_outcomes:
            self.length_prediction.labels(label).observe(ratio)
            self.queue_time_by_pool.labels(pool, label).observe(queue_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
