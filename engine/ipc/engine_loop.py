"""The engine process: drain the inbound ring, step the engine, publish token deltas; sleep on the doorbell when idle.

Started by the gateway as `python -m engine.ipc.engine_loop ARGS_JSON` (an `EngineLoopArgs`), so nothing crosses
the process boundary as pickle: the arguments are JSON, every frame after it msgspec.

The gateway owns this process's lifetime: it drains requests on SIGTERM and then sends Shutdown, so
SIGINT and SIGTERM (which a terminal or a service manager may send to the whole process group) are
ignored here. If the gateway itself dies, at any moment (the model's load included), the engine notices it was
orphaned and exits within a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import msgspec

from engine.core.config import EngineConfig, FaultPlan
from engine.core.defaults import choose_threads, usable_cores
from engine.core.lora_pool import AdapterError, AdapterNotFoundError, UnknownModelError
from engine.core.request import EngineRequest, RequestStatus
from engine.core.sampling_params import InvalidRequestError
from engine.ipc.channel import Channel, ChannelHandle
from engine.ipc.grammar_gate import Compiled, GrammarGate
from engine.ipc.memory import Memory, this_process
from engine.ipc.messages import (
    Abort,
    AddGrammar,
    AddRequest,
    CacheEvents,
    EngineReady,
    EngineStats,
    EngineSummary,
    FromEngine,
    Heartbeat,
    LoadLora,
    LoraResult,
    PromptLogprobsPart,
    ReleaseGrammar,
    RequestError,
    Shutdown,
    StepDeltas,
    ToEngine,
    TokenDelta,
    UnloadLora,
    cache_key,
)

RUNNING = RequestStatus.RUNNING
PROMPT_LOGPROBS_PART = 1024  # prompt positions per frame: with 20 alternatives each, about 350 KB of the 4 MiB ring
POSITION_VALUES = 21  # numbers a logprob position carries at most: its token's and 20 alternatives'
# Numbers per StepDeltas frame: 1024 output positions with logprobs (the same bound as above), or the pooled vectors
# of some embedding requests (a step may finish many, each as wide as the model's hidden size).
STEP_DELTAS_PART = 1024 * POSITION_VALUES
IDLE_STATS_INTERVAL = 1.0  # seconds between stats reports while idle: the gateway's liveness signal
RSS_INTERVAL = 1.0  # seconds between resident-memory samples sent with the stats
HEARTBEAT_INTERVAL = 0.25  # seconds between Heartbeats: the gateway's sign that this process answers
PARENT_POLL = 0.2  # seconds between looks at whether the gateway is still there


class EngineLoopArgs(msgspec.Struct):
    """What the gateway starts an engine process with (its one command-line argument, as JSON)."""

    config: EngineConfig
    to_engine: ChannelHandle
    from_engine: ChannelHandle
    cache_events: bool = False  # send CacheEvents after each step that named or evicted blocks (cache-aware routing)
    # The gateway's pid: the engine exits once its parent is another process (a gateway that died before this one
    # could look at its parent would otherwise pass for alive). None: whichever process is the parent at start.
    gateway_pid: int | None = None


def serving_config(config: EngineConfig) -> EngineConfig:
    """Every core by default, with a bounded OpenMP spin (gateway/engines/process.py): with OpenMP's sleeping
    default, two threads once stalled on each other under load (docs/performance.md, Pipeline stages)."""
    return config.with_(num_threads=choose_threads(config.num_threads, usable_cores()).value)


class EngineLoop:
    """Glues an EngineCore to the two channels."""

    def __init__(self, args: EngineLoopArgs, parent: int):
        self.parent = parent  # the gateway; when getppid() differs, it has died
        self.inbox = Channel.attach(args.to_engine, ToEngine)
        self.outbox = Channel.attach(args.from_engine, FromEngine)
        # The first frame tells the gateway both channels are open here, so it removes their names now, not after a
        # load that may take minutes: a gateway killed during the load would leave its doorbells in /tmp.
        self.outbox.send(Heartbeat())
        from engine.launch import build_engine, cpp_ops_origin, default_choices, grammar_compiler, kv_cache_summary

        self.engine = build_engine(serving_config(args.config))
        e = self.engine
        c = e.config  # resolved: the device and dtype are what "auto" became
        summary = EngineSummary(
            c.device,
            c.dtype,
            e.shape.num_params,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.prefix_caching,
            c.pipeline_stages,
            c.tensor_parallel_size,
            getattr(e.executor, "describe", lambda: "")(),
            cpp_ops_origin(),
            kv_cache_summary(args.config.kv_cache_dtype, c),
            default_choices(args.config, c),
        )
        compile_grammar = grammar_compiler(e)  # before ready: it builds the token table
        self.grammars = None if compile_grammar is None else GrammarGate(compile_grammar, self.inbox.doorbell.ring)
        self.cache_events = args.cache_events and c.prefix_caching
        if self.cache_events:
            e.scheduler.kv.record_events()
        self.outbox.send(EngineReady(e.model_name, e.limits, summary))
        self._stop_beating = threading.Event()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.memory, self.memory_sampled_at = Memory(0, 0), 0.0
        self.faults = c.faults or FaultPlan()

    def run(self) -> None:
        while os.getppid() == self.parent:
            for msg in self.inbox.recv_all():
                if isinstance(msg, Shutdown):
                    return
                self.handle(msg)
            if self.grammars is not None and self.grammars.busy:
                for done in self.grammars.ready():
                    self.add_compiled(done)
            if self.engine.has_unfinished():
                self.step()
            elif not self.inbox.wait(timeout=IDLE_STATS_INTERVAL):
                self.publish_stats(0.0)

    def _beat(self) -> None:
        # Its own thread, so a long step cannot silence it: the step's torch ops and the C++ ops it calls hold the GIL
        # for one op at a time at most, and the interpreter hands it over between them.
        while not self._stop_beating.wait(HEARTBEAT_INTERVAL):
            self.outbox.try_send(Heartbeat())  # a full ring: the gateway is behind and sees the other frames first

    def handle(self, msg: AddGrammar | ReleaseGrammar | AddRequest | Abort | LoadLora | UnloadLora) -> None:
        if isinstance(msg, (LoadLora, UnloadLora)):
            self.update_lora(msg)
        elif isinstance(msg, Abort):
            if self.grammars is None or not self.grammars.abort(msg.request_id):
                self.engine.abort_request(msg.request_id)
        elif isinstance(msg, (AddGrammar, ReleaseGrammar)) and self.grammars is None:
            pass  # no tokenizer, no grammars: the requests naming it fail below
        elif isinstance(msg, AddGrammar):
            self.grammars.add_grammar(msg)
        elif isinstance(msg, ReleaseGrammar):
            self.grammars.release(msg.grammar_id)
        elif msg.grammar_id is None:
            self.add(msg.request)
        elif self.grammars is None or not self.grammars.park(msg):
            self.outbox.send(RequestError(msg.request.request_id, f"unknown grammar {msg.grammar_id!r}", internal=True))

    def update_lora(self, msg: LoadLora | UnloadLora) -> None:
        """Load or unload an adapter between steps; a bad one is the caller's error, never the engine's."""
        try:
            if isinstance(msg, LoadLora):
                self.engine.load_lora(msg.name, msg.path)
            else:
                for req in self.engine.unload_lora(msg.name):  # waiting for its slot: they can no longer run
                    gone = UnknownModelError(msg.name)
                    self.outbox.send(RequestError(req.request_id, str(gone), gone.param, not_found=True))
        except AdapterError as e:
            result = LoraResult(msg.op_id, str(e), isinstance(e, AdapterNotFoundError))
        except Exception as e:  # files that broke the reader in a way it did not foresee: still the caller's
            result = LoraResult(msg.op_id, f"Loading the lora adapter '{msg.name}' failed: {e!r}")
        else:
            result = LoraResult(msg.op_id)
        if msg.op_id:
            self.outbox.send(result)

    def add_compiled(self, done: Compiled) -> None:
        request = done.request.request
        if done.error is not None:
            self.outbox.send(RequestError(request.request_id, done.error, "response_format"))
            return
        params = msgspec.structs.replace(request.params, grammar=done.grammar)
        req = self.add(msgspec.structs.replace(request, params=params))
        if req is not None:
            req.matcher = done.matcher

    def add(self, request: EngineRequest):
        """Queue a request in the engine; None (and a RequestError to the gateway) if it is invalid."""
        try:
            req = self.engine.add_request(request)
        except InvalidRequestError as e:
            self.outbox.send(
                RequestError(request.request_id, str(e), e.param, not_found=isinstance(e, UnknownModelError))
            )
            return None
        self.prompt_tokens_total += len(request.prompt_token_ids)
        return req

    def step(self) -> None:
        t = time.perf_counter()
        updated = self.engine.step()
        elapsed = time.perf_counter() - t
        with self.outbox.held_bell():  # the step's frames wake the gateway once
            if self.cache_events:  # before the step's deltas: a client's next turn must find its prefix already known
                self.send_cache_events()
            self.publish_deltas(updated)
            self.publish_stats(elapsed)

    def publish_deltas(self, updated: list) -> None:
        """The step's tokens: StepDeltas frames, plain deltas as its columns (a RequestError where one failed)."""
        deltas, num_values = [], 0
        plain = StepDeltas([])
        ids, tokens = plain.request_ids, plain.token_ids
        faults = self.faults.publish_token is not None
        # Per request per step: a running request's one new token goes in the columns, with no struct of its own.
        for req in updated:
            start, outputs = req.num_delivered_tokens, req.output_token_ids
            if (
                start
                and len(outputs) == start + 1
                and req.status is RUNNING
                and not faults
                and req.params.logprobs is None
            ):
                req.num_delivered_tokens = start + 1
                ids.append(req.request_id)
                tokens.append(outputs[start])
                continue
            if req.error is not None:
                self.outbox.send(RequestError(req.request_id, req.error, internal=True))
                continue
            try:
                if req.params.prompt_logprobs is not None and req.num_delivered_tokens == 0:
                    self.send_prompt_logprobs(req)  # before the frame with its first delta
                delta = self.delta(req)
            except Exception as e:
                self.engine.abort_request(req.request_id)
                self.outbox.send(RequestError(req.request_id, f"publishing its tokens failed: {e!r}", internal=True))
                continue
            self.generation_tokens_total += len(delta.token_ids)
            deltas.append(delta)
            if delta.logprobs is not None:
                num_values += len(delta.logprobs) * POSITION_VALUES
            if delta.embedding is not None:
                num_values += len(delta.embedding)
            if num_values >= STEP_DELTAS_PART:
                self.outbox.send(StepDeltas(deltas))
                deltas, num_values = [], 0
        self.generation_tokens_total += len(ids)
        if deltas or ids:
            plain.deltas = deltas
            self.outbox.send(plain)

    def delta(self, req) -> TokenDelta:
        """The tokens `req` got since its last delta (a step that verified drafts gives several)."""
        # Per request per step: the fault check only where a fault is planned, the lengths read directly.
        if self.faults.publish_token is not None:
            self.faults.at_publish(req.prompt_token_ids)
        start, outputs = req.num_delivered_tokens, req.output_token_ids
        req.num_delivered_tokens = len(outputs)
        lp = req.output_logprobs[start:] if req.params.logprobs is not None else None
        reason = None if req.status is RUNNING else req.finish_reason
        if start:
            if reason is None or req.embedding is None:
                return TokenDelta(req.request_id, outputs[start:], reason, lp)
            return TokenDelta(req.request_id, outputs[start:], reason, lp, None, None, req.embedding)
        # The first delta also says what admission found (and an embedding request's vector, at its end).
        embedding = req.embedding if reason is not None else None
        return TokenDelta(
            req.request_id, outputs[start:], reason, lp, req.num_cached_tokens, req.queue_seconds, embedding
        )

    def send_cache_events(self) -> None:
        stored, removed = self.engine.scheduler.kv.drain_events()
        if stored or removed:
            self.outbox.send(CacheEvents([cache_key(n) for n in stored], [cache_key(n) for n in removed]))

    def send_prompt_logprobs(self, req) -> None:
        """A request's prompt logprobs, all computed by its first token, in parts (positions 1, 2, ...)."""
        rows = req.prompt_logprobs
        for start in range(0, len(rows), PROMPT_LOGPROBS_PART):
            self.outbox.send(PromptLogprobsPart(req.request_id, start + 1, rows[start : start + PROMPT_LOGPROBS_PART]))

    def publish_stats(self, iteration_seconds: float) -> None:
        e = self.engine
        s = e.scheduler
        memory = self._memory()
        spec = s.speculation
        self.outbox.send(
            EngineStats(
                s.num_running,
                s.num_waiting,
                s.kv.num_used_blocks,
                s.kv.num_free_blocks,
                e.num_iterations,
                e.last_batch_size,
                s.num_preemptions,
                self.prompt_tokens_total,
                self.generation_tokens_total,
                e.last_batch_tokens,
                iteration_seconds,
                memory.resident_bytes,
                s.prefix_queried_tokens,
                s.prefix_hit_tokens,
                s.kv.num_cached_blocks,
                memory.private_bytes,
                *(
                    (spec.num_drafted, spec.num_accepted, spec.drain_accepted_lengths())
                    if spec is not None
                    else (0, 0, [])
                ),
                s.policy.drain_length_outcomes(),
                spec.step_cost.value if spec is not None else 0.0,
                dict(runner.step_paths) if (runner := getattr(e.executor, "runner", None)) is not None else {},
            )
        )

    def _memory(self) -> Memory:
        now = time.monotonic()
        if now - self.memory_sampled_at >= RSS_INTERVAL:
            self.memory_sampled_at = now
            self.memory = this_process() or Memory(0, 0)  # not Linux: the metrics stay absent
        return self.memory

    def close(self) -> None:
        self._stop_beating.set()
        if self.grammars is not None:
            self.grammars.close()
        self.engine.close()  # pipeline stages, if any, are stopped with it
        self.inbox.close()
        self.outbox.close()


def exit_when_orphaned(parent: int) -> None:
    """An engine whose gateway died has nobody to serve, and may be in the middle of a load that lasts minutes (or
    waits on something that never comes): it exits, whatever the main thread is doing. Its pipeline stages, if any,
    follow it the same way."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    print(f"orcinus engine: its gateway (pid {parent}) exited; exiting", file=sys.stderr, flush=True)
    os._exit(0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = msgspec.json.decode(argv[1], type=EngineLoopArgs)
    parent = args.gateway_pid or os.getppid()  # first thing: the gateway may die while the model loads
    threading.Thread(target=exit_when_orphaned, args=(parent,), name="orcinus-orphan-watch", daemon=True).start()
    # uvicorn's format, so the engine's start-up lines (graph capture time and memory) read like the gateway's.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     [engine] %(message)s")
    try:
        engine_loop = EngineLoop(args, parent)
    except Exception:  # the model did not load: the gateway reports the exit, this log says why
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not through the interpreter's teardown, whose collection of the rings' views only adds noise
    try:
        engine_loop.run()
    finally:
        engine_loop.close()
    # All is closed, stopped or saved above: tearing down the interpreter (torch, the model) only slowed every
    # server's shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
