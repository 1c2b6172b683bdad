"""The engine: one iteration is schedule -> run -> sample -> update (Orca's Algorithm 1)."""

from __future__ import annotations

import itertools
import time

import torch

from engine.config import EngineConfig
from engine.device import kv_cache_bytes, resolve_device
from engine.loader import Checkpoint, load_checkpoint
from engine.model import LlamaModel
from engine.request import Request
from engine.request_limits import RequestLimits
from engine.runner import ModelRunner, kv_bytes_per_block
from engine.sampler import Sampler
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler


class EngineCore:
    """Owns the model, the scheduler and the sampler; callers add requests and call `step()`."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        """`checkpoint` reuses weights already loaded (e.g. to try several configs on one model)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config = resolve_device(config)
        self.config = config
        ckpt = checkpoint or load_checkpoint(config.model, config.seed)
        self.model_name = ckpt.name
        self.shape = ckpt.shape
        self.tokenizer = ckpt.tokenizer
        self.max_model_len = min(config.max_model_len or ckpt.shape.max_position, ckpt.shape.max_position)
        self.model = build_model(ckpt, self.max_model_len, config)
        dtype = getattr(torch, config.dtype)
        # Sized after the weights are loaded: on a GPU the KV cache takes what they leave free.
        num_blocks = kv_cache_bytes(config, self.shape) // kv_bytes_per_block(self.shape, config.block_size, dtype)
        self.runner = ModelRunner(config, self.model, num_blocks, self.max_model_len)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.sampler = Sampler(config.seed, torch.device(config.device))
        self.limits = RequestLimits(self.max_model_len, self.shape.vocab_size, num_blocks, config.block_size)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self._ids = itertools.count()
        self.num_iterations = 0
        self.last_batch_size = 0
        self.last_batch_tokens = 0

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
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One iteration; returns the requests that got a new token (finished ones included)."""
        batch = self.scheduler.schedule()
        self.last_batch_size = len(batch)
        self.last_batch_tokens = batch.num_tokens
        if not batch.requests:
            return []
        logits = self.runner.run(batch)
        sampled = self.sampler(logits, [self.scheduler.requests[r.request_id] for r in batch.requests if r.sample])
        self.num_iterations += 1
        return self.scheduler.update(batch, sampled)


def build_model(ckpt, max_position: int, config: EngineConfig) -> LlamaModel:
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    with torch.device("meta"):
        model = LlamaModel(ckpt.shape, max_position)
    # Allocate without torch's random init: every parameter is overwritten next.
    model = model.to_empty(device=device)
    model.materialize_buffers()
    if ckpt.weights:
        model.load_weights(ckpt.weights)
    else:
        model.init_random(config.seed)
    # Parameters only: the RoPE tables stay float32.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)
