"""The scheduler's fast path for its commonest work: running requests that each decode one token.

Scheduling a running request is, in general, `Scheduler._num_schedulable`, `KVCacheManager.allocate` (with
preemption where blocks run out) and `Scheduler._columnar`'s bookkeeping; updating it, `Scheduler._update_decode`.
For a plain decode row (one token, sampled, no drafts, probes or logprobs) nearly all of that is the same few counters
each step, so it runs here as one loop each way with no call per row; anything else is handed to the general path,
before this path has touched the request.
"""

from __future__ import annotations

from engine.core.request import SampledTokens


def schedule_plain_decodes(sched, rows, max_seqs: int, budget: int, placeholder: int) -> tuple[int, int]:
    """Schedule `sched.running` in order as plain decode rows appended to `rows` (a DecodeRows), until `rows` holds
    `max_seqs`, the budget is spent or a request needs more than one token or a block when none is free. Returns
    where in `sched.running` the general path (`Scheduler._schedule_running`) goes on, and the budget left.

    Invariant: each request it passes is left exactly as the general path would leave it (skipped, or scheduled with
    its slot allocated and its row's bookkeeping done); the one it stops at is untouched. The caller uses it only where
    the general path would put a one-token row in `Batch.decode` (no speculation, probes or reserving KV policy).
    """
    running, in_flight, drafting, kv = sched.running, sched.in_flight, sched.drafting, sched.kv
    run_ahead = sched.run_ahead
    check_ins, runs_long = sched.check_in_steps > 1 and not sched.waiting, sched.policy.runs_long
    block_size, allocate = kv.block_size, kv.allocate
    ids, tokens, moved, positions = rows.request_ids, rows.token_ids, rows.moved, rows.positions
    room = min(max_seqs - len(ids), budget)  # each row takes one token of the budget and one of the seats
    taken = 0
    # Per running request per step: _num_schedulable, allocate's test and _columnar's bookkeeping, inlined.
    for i, req in enumerate(running):
        if taken >= room:
            return i, budget - taken
        rid = req.request_id
        flying = in_flight.get(rid, 0)
        outputs = req.output_token_ids
        num_outputs = len(outputs)
        num_prompt = len(req.prompt_token_ids)
        known = num_prompt + num_outputs
        pending = req.num_pending_outputs
        if flying:
            if not run_ahead or flying > 1 or rid in drafting or (check_ins and runs_long(req)):
                continue  # nothing it may compute before its batch in flight comes back
            # Not ahead of a token its sampling must see, nor of one that may reach max_tokens or the context window.
            if pending and (
                req.samples_from_outputs
                or num_outputs < req.params.min_tokens
                or num_outputs + pending >= req.output_limit
            ):
                continue
            start = req.num_computed_tokens + req.num_in_flight_tokens
            num_new = known + pending - start
        else:
            start = req.num_computed_tokens + req.num_in_flight_tokens
            num_new = known - req.num_computed_tokens
        if num_new == 0:
            continue
        if num_new != 1 or start < num_prompt or start + 1 != known + pending:
            return i, budget - taken  # a prompt chunk, or a row that does not sample: the general path's
        table = req.block_table
        if start >= len(table) * block_size and not allocate(req, 1):
            return i, budget - taken  # no block free: the general path preempts
        k = len(ids)
        ids.append(rid)
        tokens.append(outputs[start - num_prompt] if start < known else placeholder)
        if start != req.num_sent_tokens:
            moved.append(k)
            positions.append(start)
        req.num_sent_tokens = start + 1
        in_flight[rid] = flying + 1
        req.num_in_flight_tokens += 1
        req.num_pending_outputs = pending + 1
        sent = req.num_sent_blocks
        if len(table) != sent:
            rows.grown.append(k)
            rows.block_offsets.append(sent)
            rows.blocks.append(table[sent:])
            req.num_sent_blocks = len(table)
        taken += 1
    return len(running), budget - taken


def update_plain_decodes(sched, request_ids: list[str], sampled: dict, updated: list) -> None:
    """Scheduler.update for the plain decode rows (`Batch.decode`): one token computed and one sampled each.

    Invariant: a row that only appends its token (no stop token, no length limit reached, no logprobs, no block
    filled, no sliding window) is done here; every other goes through `Scheduler._update_decode_row`, as it would
    without this loop.
    """
    in_flight, drafting, requests, kv = sched.in_flight, sched.drafting, sched.requests, sched.kv
    block_size = kv.block_size if kv.prefix_caching else None
    plain = not sched.kv_window
    slow = sched._update_decode_row
    # Per request per step: the bookkeeping of one appended token, inlined (the lookups mapped in C).
    for rid, req, result in zip(request_ids, map(requests.get, request_ids), map(sampled.__getitem__, request_ids)):
        left = in_flight[rid] - 1
        if left:
            in_flight[rid] = left
        else:
            del in_flight[rid]
        if drafting:
            drafting.discard(rid)
        if req is None:  # aborted, or finished by the batch before (a row scheduled ahead): its token is dropped
            continue
        if type(result) is SampledTokens and result.logprobs is None and plain:
            token_id = result.token_ids[0]
            outputs = req.output_token_ids
            computed = req.num_computed_tokens + 1
            if (
                token_id not in req.stop_token_ids
                and len(outputs) + 1 < req.output_limit
                and (block_size is None or computed // block_size <= req.num_registered_blocks)
            ):
                req.num_in_flight_tokens -= 1
                req.num_pending_outputs -= 1
                req.num_computed_tokens = computed
                outputs.append(token_id)
                updated.append(req)
                continue
        slow(req, result, updated)
