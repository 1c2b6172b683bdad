"""The contract between the engine core and whatever runs its batches (this process, or pipeline stages)."""

from __future__ import annotations

from typing import Protocol

from engine.core.batch import Batch
from engine.core.request import Failure, Request, SampledTokens, TokenLogprobs

# Every request of a batch that samples gets its tokens (accepted drafts, then one sampled) or a Failure; one that
# only computed gets a Failure or nothing.
Sampled = dict[str, SampledTokens | Failure]
# Every request of a batch whose chunk asked for prompt logprobs (ScheduledRequest.prompt_logprobs): one per row.
PromptLogprobs = dict[str, list[TokenLogprobs]]


class Executor(Protocol):
    """Takes batches in order and hands back each one's sampled tokens in the same order."""

    max_in_flight: int  # batches that may be submitted before the oldest is collected
    num_blocks: int  # KV blocks every part of the model has room for
    max_steps: int  # decode steps one batch may run (Batch.num_steps); one where the executor lacks this

    @property
    def num_in_flight(self) -> int: ...

    def submit(self, batch: Batch, sampling: list[Request]) -> None:
        """Start `batch`; `sampling` are the requests of its rows that sample, in batch order."""

    def collect(self) -> tuple[Batch, Sampled, PromptLogprobs]:
        """The oldest submitted batch, its sampled tokens and its prompt logprobs (blocks until they are there)."""

    def release(self, request_ids: list[str]) -> None:
        """These requests are gone: drop any state kept for them."""

    def close(self) -> None: ...

    # LoRA (engine/core/lora_pool.py decides residency; only executors that serve adapters have these):
    def add_lora(self, name: str, path: str) -> None:
        """Read an adapter to the host, checked against the model (AdapterError if it does not fit)."""

    def load_lora(self, slot: int, name: str) -> None:
        """Put a host adapter's weights in `slot`, ahead of any batch submitted after this call."""

    def remove_lora(self, name: str) -> None:
        """Drop the host copy (a slot it is in keeps its weights until reloaded)."""
