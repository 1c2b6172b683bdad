"""Several decode steps in one executor call (Batch.num_steps, --check-in-steps): each row's sampled token is its next
input, and a row that ends (a stop token, max_tokens, the context window) runs no later step, so nothing past its end
is computed or returned. The scheduler sees the tokens at the check-in, as it sees a step's accepted drafts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.batch import Batch, ScheduledRequest
from engine.core.executor import Sampled
from engine.core.request import Failure, SampledTokens, TokenLogprobs
from engine.model.sampling.state import SamplingState

# (logits, request ids) -> each request's tokens from one step, or its Failure
SampleStep = Callable[[torch.Tensor, list[str]], Sampled]
# (batch, is it the run's first step) -> the logits of its rows, or a Failure for all of them
Forward = Callable[[Batch, bool], torch.Tensor | Failure]


def ends(state: SamplingState, token_id: int, max_model_len: int) -> bool:
    """Whether `token_id`, just appended to the request's outputs, ends it (the scheduler's own stop checks)."""
    num_outputs, params = state.num_output_tokens, state.params
    return (
        (token_id in state.stop_token_ids and num_outputs >= params.min_tokens)
        or num_outputs >= params.max_tokens
        or len(state.prompt_token_ids) + num_outputs >= max_model_len
    )


def run_steps(
    batch: Batch,
    forward: Forward,
    sample: SampleStep,
    states: dict[str, SamplingState],
    max_model_len: int,
) -> Sampled:
    """Up to `batch.num_steps` decode steps of its rows (one token each, none drafting); each request's tokens in
    order, or a Failure where its forward pass or sampling raised."""
    rows = batch.requests
    # A row keeps its adapter slot through the run (LoRA): the later steps' batches carry it too.
    slots = None if batch.lora_slots is None else dict(zip([r.request_id for r in rows], batch.lora_slots))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in rows}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    failed: dict[str, Failure] = {}
    for step in range(batch.num_steps):
        if step:
            batch = Batch(rows, None if slots is None else [slots[r.request_id] for r in rows])
        logits = forward(batch, step == 0)
        if isinstance(logits, Failure):
            failed.update((r.request_id, logits) for r in rows)
            break
        sampled = sample(logits, [r.request_id for r in rows])
        following = []
        for r in rows:
            rid = r.request_id
            out = sampled[rid]
            if isinstance(out, Failure):
                failed[rid] = out
                continue
            token_id = out.token_ids[-1]
            tokens[rid].append(token_id)
            if out.logprobs is not None:
                logprobs.setdefault(rid, []).extend(out.logprobs)
            if not ends(states[rid], token_id, max_model_len):
                # Its slots were allocated for the whole run and the first step brought their blocks: the runner holds
                # them all, so the later steps bring none (ScheduledRequest.block_offset).
                held = r.block_offset + len(r.block_table)
                following.append(
                    ScheduledRequest(rid, [token_id], r.num_computed_tokens + 1, [], True, block_offset=held)
                )
        rows = following
        if not rows:
            break
    return {rid: failed.get(rid) or SampledTokens(ids, logprobs.get(rid)) for rid, ids in tokens.items()}
