"""The engine: one iteration is schedule -> run -> update (Orca's Algorithm 1), with batches in flight."""

from __future__ import annotations

import itertools
import time

import torch

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.executor import Executor, LocalExecutor
from engine.loader import Checkpoint, load_checkpoint
from engine.request import Request
from engine.request_limits import RequestLimits
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler


class EngineCore:
    """Owns the scheduler and an executor (the model here, or pipeline stages); callers add requests and `step()`."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        """`checkpoint` reuses weights already loaded (e.g. to try several configs on one model)."""
        config = resolve_device(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        pipelined = config.pipeline_stages > 1
        ckpt = checkpoint or load_checkpoint(config.model, config.seed, weights=not pipelined)
        self.model_name = ckpt.name
        self.shape = ckpt.shape
        self.tokenizer = ckpt.tokenizer
        self.max_model_len = min(config.max_model_len or ckpt.shape.max_position, ckpt.shape.max_position)
        if pipelined:
            from engine.pipeline import PipelineExecutor  # torch.distributed only where it is used

            self.executor: Executor = PipelineExecutor(config, self.max_model_len)
        else:
            self.executor = LocalExecutor(config, ckpt, self.max_model_len)
        num_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.limits = RequestLimits(self.max_model_len, self.shape.vocab_size, num_blocks, config.block_size)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self._ids = itertools.count()
        self.num_iterations = 0
        self.last_batch_size = 0
        self.last_batch_tokens = 0
        self.max_batches_in_flight = 0

    @property
    def runner(self):
        return self.executor.runner  # in-process execution only

    @property
    def model(self):
        return self.executor.model  # in-process execution only

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError for one that can never run."""
        self.limits.check(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        req = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_id)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> Request | None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self.executor.release([request_id])
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.executor.num_in_flight > 0

    def step(self) -> list[Request]:
        """One iteration: fill the pipeline with batches, then finish the oldest; returns requests that got a token."""
        while (free := self.executor.max_in_flight - self.executor.num_in_flight) > 0:
            batch = self.scheduler.schedule(num_batches=free)
            if not batch.requests:
                break
            self.executor.submit(batch, [self.scheduler.requests[r.request_id] for r in batch.requests if r.sample])
            self.last_batch_size, self.last_batch_tokens = len(batch), batch.num_tokens
            self.max_batches_in_flight = max(self.max_batches_in_flight, self.executor.num_in_flight)
        if not self.executor.num_in_flight:
            self.last_batch_size = self.last_batch_tokens = 0
            return []
        batch, sampled = self.executor.collect()
        self.num_iterations += 1
        updated = self.scheduler.update(batch, sampled)
        self.executor.release([r.request_id for r in updated if r.status.finished])
        return updated

    def close(self) -> None:
        """Stop the executor's processes, if it has any."""
        self.executor.close()
