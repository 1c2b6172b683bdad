"""The engine: one iteration is schedule -> run -> update (Orca's Algorithm 1), with batches in flight."""

from __future__ import annotations

import itertools
import time
from collections import deque

from engine.core.config import EngineConfig, ModelShape
from engine.core.executor import Executor
from engine.core.lora_pool import AdapterError, AdapterGate, UnknownModelError, parse_lora
from engine.core.queue_policy import QueuePolicy
from engine.core.request import NO_OPTIONS, EngineRequest, Request, RequestOptions
from engine.core.request_limits import RequestLimits
from engine.core.sampling_params import InvalidRequestError, SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.speculation import DraftSource, Speculation


class EngineCore:
    """Owns the scheduler and an executor (the model here, or pipeline stages); callers add requests and `step()`.

    Built by `engine.launch.build_engine`, which loads the model and picks the executor.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        model_name: str,
        shape: ModelShape,
        tokenizer,
        max_model_len: int,
        draft_source: DraftSource | None = None,
        policy: QueuePolicy | None = None,
    ):
        self.config = config
        self.executor = executor
        self.model_name = model_name
        self.shape = shape
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        num_blocks = executor.num_blocks
        # Speculative decoding: `draft_source` (engine/drafting) makes each request's drafter, as --speculative names.
        speculation = (
            None
            if draft_source is None
            else Speculation(draft_source, config.num_speculative_tokens, config.speculative_row_cost)
        )
        # `policy`: who runs first (None: the config's, as named); launch builds the `predicted` one with its predictor.
        self.scheduler = Scheduler(config, num_blocks, max_model_len, shape.kv_window, speculation, policy)
        self.scheduler.check_in_steps = min(config.check_in_steps, getattr(executor, "max_steps", 1))
        self.scheduler.columnar_decode = True  # every executor reads Batch.decode
        # A windowed request holds its window, the chunk being computed, and a partial block at each end.
        held = shape.kv_window + config.max_num_batched_tokens + 2 * config.block_size if shape.kv_window else 0
        self.limits = RequestLimits(max_model_len, shape.vocab_size, num_blocks, config.block_size, held)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self._ids = itertools.count()
        self.num_iterations = 0
        self.last_batch_size = 0
        self.last_batch_tokens = 0
        self.max_batches_in_flight = 0
        self._submitted_at: deque[float] = deque()  # of the batches in flight, oldest first
        self._last_collected = 0.0
        # LoRA adapters: which are resident, and the requests waiting for a slot (None: no adapters served).
        self.adapters = AdapterGate(config.max_loras, executor.load_lora) if config.lora_enabled else None
        for spec in config.lora:
            self.load_lora(*parse_lora(spec))

    @property
    def runner(self):
        return self.executor.runner  # in-process execution only

    @property
    def model(self):
        return self.executor.model  # in-process execution only

    def add_request(
        self,
        request: EngineRequest | list[int],
        params: SamplingParams | None = None,
        options: RequestOptions = NO_OPTIONS,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError for one that can never run. Prompt token ids
        with `params` (and `options`) stand for an EngineRequest under a fresh id (the offline shorthand)."""
        if not isinstance(request, EngineRequest):
            request = EngineRequest(f"req-{next(self._ids)}", request, params, options)
        self.limits.check(request.prompt_token_ids, request.params)
        request_id = request.request_id
        # An id whose batch is still in flight is taken too: that batch's tokens must not reach a newcomer.
        if request_id in self.scheduler.requests or request_id in self.scheduler.in_flight:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        req = Request(
            request_id,
            list(request.prompt_token_ids),
            request.params,
            time.monotonic(),
            self.eos_token_id,
            request.options,
        )
        if self.adapters is None:
            if request.options.lora:
                raise UnknownModelError(request.options.lora)
            self.scheduler.add(req)
        else:
            self.adapters.add(req, self.scheduler.add)
        return req

    def abort_request(self, request_id: str) -> Request | None:
        if self.adapters is not None and (held := self.adapters.abort(request_id)) is not None:
            return held
        req = self.scheduler.abort(request_id)
        if req is not None:
            self.executor.release([request_id])
            if self.adapters is not None:
                self.adapters.done([request_id])
        return req

    def load_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter under `name` (AdapterError if it is loaded already, or does not fit the model)."""
        if self.adapters is None:
            raise AdapterError("LoRA adapters are not enabled: start the server with --enable-lora or --lora")
        if name in self.adapters.pool.ids:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        self.executor.add_lora(name, path)
        self.adapters.pool.register(name)

    def unload_lora(self, name: str) -> list[Request]:
        """Stop serving an adapter (AdapterNotFoundError if not loaded): requests running under it finish; those
        still waiting for its slot are returned, dropped."""
        if self.adapters is None:
            raise AdapterError("LoRA adapters are not enabled: start the server with --enable-lora or --lora")
        dropped = self.adapters.unload(name)
        self.executor.remove_lora(name)
        return dropped

    def has_unfinished(self) -> bool:
        held = self.adapters is not None and bool(self.adapters.held)
        return self.scheduler.has_unfinished() or self.executor.num_in_flight > 0 or held

    def step(self) -> list[Request]:
        """One iteration: fill the pipeline with batches (stages, or a batch scheduled ahead of the device), then
        finish the oldest; returns requests that got a token."""
        if self.adapters is not None:
            self.adapters.admit_held(self.scheduler.add)
        while (free := self.executor.max_in_flight - self.executor.num_in_flight) > 0:
            batch = self.scheduler.schedule(num_batches=free)
            if not len(batch):
                break
            if self.adapters is not None:
                batch.lora_slots = self.adapters.slots(batch.request_ids)
            started = time.monotonic()  # a local executor runs the batch in submit, others in the background
            requests = self.scheduler.requests
            self.executor.submit(batch, [requests[request_id] for request_id in batch.sampling_ids])
            self._submitted_at.append(started)
            self.last_batch_size, self.last_batch_tokens = len(batch), batch.num_tokens
            self.max_batches_in_flight = max(self.max_batches_in_flight, self.executor.num_in_flight)
        if not self.executor.num_in_flight:
            self.last_batch_size = self.last_batch_tokens = 0
            return []
        batch, sampled, prompt_logprobs = self.executor.collect()
        # The batch's time: from its submission, or from the one before it ending if it waited in line behind it.
        now = time.monotonic()
        seconds = now - max(self._submitted_at.popleft(), self._last_collected)
        self._last_collected = now
        self.num_iterations += 1
        updated = self.scheduler.update(batch, sampled, prompt_logprobs, seconds)
        finished = [r.request_id for r in updated if r.status.finished]
        self.executor.release(finished)
        if self.adapters is not None:
            self.adapters.done(finished)
        return updated

    def close(self) -> None:
        """Stop the executor's processes, if it has any; keep what the scheduling policy learnt."""
        self.scheduler.policy.close()
        self.executor.close()
