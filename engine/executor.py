"""Runs scheduled batches: in this process (one batch at a time), or down a pipeline of stage processes."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from engine.config import EngineConfig, ModelShape
from engine.device import kv_cache_bytes
from engine.loader import Checkpoint
from engine.model import LlamaModel
from engine.request import Request, TokenLogprobs
from engine.runner import ModelRunner, kv_bytes_per_block
from engine.sampler import Sampler
from engine.scheduler import Batch

Sampled = dict[str, tuple[int, TokenLogprobs | None]]


class Executor(Protocol):
    """Takes batches in order and hands back each one's sampled tokens in the same order."""

    max_in_flight: int  # batches that may be submitted before the oldest is collected
    num_blocks: int  # KV blocks every part of the model has room for

    @property
    def num_in_flight(self) -> int: ...

    def submit(self, batch: Batch, sampling: list[Request]) -> None:
        """Start `batch`; `sampling` are the requests of its rows that sample, in batch order."""

    def collect(self) -> tuple[Batch, Sampled]:
        """The oldest submitted batch and its sampled tokens (blocks until they are there)."""

    def release(self, request_ids: list[str]) -> None:
        """These requests are gone: drop any state kept for them."""

    def close(self) -> None: ...


def stage_span(num_layers: int, stage: int, num_stages: int) -> range:
    """Stage `stage`'s layers when `num_layers` are split as evenly as they go (earlier stages take the extras)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def build_model(ckpt: Checkpoint, max_position: int, config: EngineConfig, span: range | None = None) -> LlamaModel:
    """The model (or one stage's span of it) on the configured device and dtype, with the checkpoint's weights."""
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    with torch.device("meta"):
        model = LlamaModel(ckpt.shape, max_position, span)
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


def num_kv_blocks(config: EngineConfig, shape: ModelShape, num_layers: int) -> int:
    dtype = getattr(torch, config.dtype)
    return kv_cache_bytes(config, shape) // kv_bytes_per_block(shape, config.block_size, dtype, num_layers)


class LocalExecutor:
    """The whole model in this process: each batch runs and samples as it is submitted."""

    max_in_flight = 1

    def __init__(self, config: EngineConfig, ckpt: Checkpoint, max_model_len: int):
        self.model = build_model(ckpt, max_model_len, config)
        # Sized after the weights are loaded: on a GPU the KV cache takes what they leave free.
        self.num_blocks = num_kv_blocks(config, ckpt.shape, ckpt.shape.num_layers)
        self.runner = ModelRunner(config, self.model, self.num_blocks, max_model_len)
        self.sampler = Sampler(config.seed, torch.device(config.device))
        self.done: deque[tuple[Batch, Sampled]] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self.done)

    def submit(self, batch: Batch, sampling: list[Request]) -> None:
        self.done.append((batch, self.sampler(self.runner.run(batch), sampling)))

    def collect(self) -> tuple[Batch, Sampled]:
        return self.done.popleft()

    def release(self, request_ids: list[str]) -> None:
        pass  # the sampler keeps nothing per request here: it reads the scheduler's own Request objects

    def close(self) -> None:
        pass
