"""Fewer check-ins for long requests (--check-in-steps): when a batch may run several decode steps in one executor
call, and the KV blocks those steps write.

The executor feeds each row's sampled token back as its next input and stops a row at a stop token, max_tokens or
the context window, returning up to `num_steps` tokens per row; the scheduler appends them as it does a step's
accepted drafts. A batch runs several steps only where nothing else could have happened at the steps skipped: every
running request is in it, decoding one known token with no drafts, none waits for admission or is in flight, and the
queue policy lets each run long (a policy that predicts lengths checks its short requests every step).
"""

from __future__ import annotations

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request


def may_run_long(rows: list, reqs: list[Request], runs_long) -> bool:
    """Whether every row (the batch's ScheduledRequests) is a plain decode of a request the policy lets run several
    steps; asked only with nothing in flight, so no row waits for a token still on the device."""
    for sr, req in zip(rows, reqs):
        if (
            not sr.sample
            or sr.num_draft
            or len(sr.token_ids) != 1
            or sr.prompt_logprobs is not None
            or req.params.grammar is not None  # its matcher may end it, which only the host would see
            or not runs_long(req)
        ):
            return False
    return True


def reserve_steps(kv: KVCacheManager, reqs: list[Request], max_steps: int, max_model_len: int) -> int:
    """The most steps (up to `max_steps`) whose KV slots every request can have, allocated; 1 where none fit.

    A request takes slots only for the steps it can use (its max_tokens and the context window end it sooner); its first
    step's token is in flight already (the batch counted it), with its slot."""
    for steps in range(max_steps, 1, -1):
        uses = [_usable(req, steps, max_model_len) for req in reqs]
        if max(uses) <= 1:
            return 1
        missing = sum(
            max(0, kv.blocks_for(_slots(kv, req, n - 1)) - len(req.block_table)) for req, n in zip(reqs, uses)
        )
        if missing <= kv.num_free_blocks:
            for req, n in zip(reqs, uses):
                if n > 1:
                    kv.allocate(req, n - 1)  # cannot fail: counted above
            return max(uses)
    return 1


def _usable(req: Request, steps: int, max_model_len: int) -> int:
    """Steps of a run `req` can take: one token each, until max_tokens or the context window."""
    num_outputs = len(req.output_token_ids)
    left = min(req.params.max_tokens - num_outputs, max_model_len - len(req.prompt_token_ids) - num_outputs)
    return max(1, min(steps, left))


def _slots(kv: KVCacheManager, req: Request, num_new: int) -> int:
    return kv.slots_needed(req, req.num_computed_tokens + req.num_in_flight_tokens + num_new)
