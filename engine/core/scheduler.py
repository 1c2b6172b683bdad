"""Decides who runs this iteration (Orca's iteration-level scheduling, FCFS, with preemption)."""

from __future__ import annotations

import time
from collections import Counter

from engine.core.batch import PLACEHOLDER, Batch, PromptLogprobRows, ScheduledRequest
from engine.core.check_ins import may_run_long, reserve_steps
from engine.core.config import EngineConfig
from engine.core.kv_cache import KVCacheManager
from engine.core.plain_decodes import schedule_plain_decodes, update_plain_decodes
from engine.core.queue_policy import QueuePolicy, WaitingQueue, queue_policy
from engine.core.request import Failure, Request, RequestStatus, SampledTokens, TokenLogprobs
from engine.core.speculation import Speculation, StepDrafts


class IterationLevel:
    """Orca: new requests may join at every iteration while the token budget has room."""

    def may_admit(self, num_running_at_start: int, budget_left: int) -> bool:
        return budget_left > 0


class RequestLevel:
    """Baseline (FasterTransformer/Triton style): form a batch only once the previous one has drained."""

    def may_admit(self, num_running_at_start: int, budget_left: int) -> bool:
        return num_running_at_start == 0


ADMISSION_POLICIES = {"iteration": IterationLevel, "request": RequestLevel}


class Scheduler:
    """Running requests first, then the waiting queue in the policy's order (engine/core/queue_policy.py);
    preempts the newest of the policy's highest rank when blocks run out."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        kv_window: int | None = None,
        speculation: Speculation | None = None,
        policy: QueuePolicy | None = None,
    ):
        self.config = config
        self.max_model_len = max_model_len
        self.kv_window = kv_window  # every layer's sliding window: blocks before it go back as requests move on
        self.kv = KVCacheManager(num_blocks, config.block_size, config.kv_policy, config.prefix_caching)
        self.admission = ADMISSION_POLICIES[config.scheduling]()
        # The config's, unless given one built with more (the `predicted` policy's length predictor).
        self.policy = policy if policy is not None else queue_policy(config.scheduling_policy)()
        self.waiting = WaitingQueue(self.policy)
        self.max_running = config.max_num_seqs * self.policy.RUNNING_PER_SEQ  # requests holding KV blocks
        # More may hold blocks than an iteration takes: the policy's order picks who runs, and newcomers may take
        # slots and blocks from running requests that rank after them.
        self.reorders = self.max_running > config.max_num_seqs
        self.num_arrived = 0
        self.running: list[Request] = []  # in admission order: oldest first
        self.requests: dict[str, Request] = {}
        # Batches submitted but not yet updated, per request id: at most one (Orca), or two when a request is
        # scheduled ahead of its own sampled token (async scheduling: the host schedules step N+1 while the
        # device runs step N).
        self.in_flight: Counter[str] = Counter()
        self.run_ahead = config.async_scheduling == "on"
        self.speculation = speculation  # None: no drafts, one token per request per step
        # Requests whose batch in flight may give several tokens (drafts to verify, several steps): none runs ahead.
        self.drafting: set[str] = set()
        self.check_in_steps = config.check_in_steps  # most steps a batch runs between check-ins (EngineCore may lower)
        # Plain decode rows go as Batch.decode's columns (EngineCore sets it; a batch of ScheduledRequests alone is
        # what tests of the scheduler read).
        self.columnar_decode = False
        # Plain decode rows may take the fast path (engine/core/plain_decodes.py); tests turn it off to compare.
        self.fast_decode = True
        self.num_preemptions = 0
        self.dropped: list[str] = []  # requests gone from the running since the last batch (Batch.dropped)
        self.newcomers_ran_alone = False  # the last batch took new prompts only (`_newcomers_alone`)
        # Tokens of admitted requests (prompt, plus outputs after a preemption) looked up in the prefix cache.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0  # of those, found there (not computed again)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.output_limit = min(req.params.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        req.arrival_order = self.num_arrived
        self.num_arrived += 1
        self.waiting.add(req)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks; call between iterations.

        Freeing blocks of a request whose batch is still in flight is safe: every stage runs batches
        in submission order, so whoever gets the blocks next writes them after that batch did.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        self.dropped.append(request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        return req

    def schedule(self, num_batches: int = 1) -> Batch:
        """The next batch. With pipeline stages free for `num_batches` batches, take a 1/num_batches share of
        the requests that could run, so the batches in flight split them and every stage has work."""
        budget = self.config.max_num_batched_tokens
        num_running_at_start = len(self.running)
        idle = not self.in_flight  # before this batch's requests count in flight
        # A batch that may run several steps (check-ins) goes as ScheduledRequests: engine/runner/check_in_steps.py.
        columnar = self.columnar_decode and not (self.check_in_steps > 1 and idle)
        scheduled: list[tuple[Request, int, list[int]]] = []
        max_seqs = self.config.max_num_seqs
        if not self.run_ahead:  # running ahead, consecutive batches share their requests rather than split them
            num_ready = len(self.waiting) + sum(r.request_id not in self.in_flight for r in self.running)
            max_seqs = min(max_seqs, -(-num_ready // num_batches))
        if self.reorders:
            self.running.sort(key=self.policy.key)
            self._make_room(budget)
        max_running_seqs = self._running_slots(max_seqs)
        alone = self._newcomers_alone()
        batch, first = Batch([]), 0
        if (
            columnar
            and self.fast_decode
            and self.speculation is None
            and not self.policy.probing
            and self.config.kv_policy == "paged"
            and not alone
        ):
            first, budget = schedule_plain_decodes(self, batch.decode, max_running_seqs, budget, PLACEHOLDER)
        num_fast = len(batch.decode)
        budget = self._schedule_running(scheduled, 0 if alone else max_running_seqs - num_fast, budget, first)
        budget = self._admit_waiting(scheduled, max_seqs - num_fast, budget, num_running_at_start)
        # Slots kept for newcomers (all of them when newcomers run alone, else those _running_slots held back) that
        # they did not take (they did not fit, wait for a block a running request is computing, or admission refused
        # them) go to the running requests, or nobody might ever run again.
        kept_for_newcomers = not scheduled if alone else max_running_seqs < max_seqs
        if kept_for_newcomers:
            taken = {req.request_id for req, _, _ in scheduled}.union(batch.decode.request_ids)
            self._schedule_running(scheduled, max_seqs - num_fast, budget, taken=taken)
        self.newcomers_ran_alone = alone and bool(scheduled)

        if columnar:
            self._columnar(scheduled, batch)
        else:
            batch.requests = [self._to_scheduled(req, n, draft) for req, n, draft in scheduled]
        if len(batch) and self.dropped:  # an empty batch is never submitted: they go with the next one
            batch.dropped, self.dropped = self.dropped, []
        if self.check_in_steps > 1 and idle and batch.requests:
            batch.num_steps = self._steps_to_check_in(batch, [req for req, _, _ in scheduled])
        return batch

    def _steps_to_check_in(self, batch: Batch, reqs: list[Request]) -> int:
        """Steps `batch` may run before its next check-in, their KV slots allocated: 1 unless every running request is
        in it, nothing waits (nor, as the caller saw, is in flight) and the policy lets each run long (check_ins.py)."""
        if (
            self.waiting
            or len(reqs) != len(self.running)
            or not may_run_long(batch.requests, reqs, self.policy.runs_long)
        ):
            return 1
        steps = reserve_steps(self.kv, reqs, self.check_in_steps, self.max_model_len)
        if steps > 1:
            for sr, req in zip(batch.requests, reqs):
                self.drafting.add(req.request_id)  # several tokens come back: nothing runs ahead of them
                # The blocks reserved for the run go with it (the runners hold those before block_offset).
                sr.block_table = req.block_table[sr.block_offset :]
                req.num_sent_blocks = len(req.block_table)
        return steps

    def _schedule_running(
        self,
        scheduled: list[tuple[Request, int, list[int]]],
        max_seqs: int,
        budget: int,
        i: int = 0,
        taken: set[str] | None = None,
    ) -> int:
        """Running requests in order from the `i`th (but those in `taken`, in this batch already), until `scheduled`
        holds `max_seqs`; preempts where blocks run out, then gives the decoding ones drafts from what is left. Returns
        the budget left."""
        # Every running request's tokens first: a draft takes only the budget and blocks they leave, so it never
        # makes a later request preempt itself or wait.
        first = len(scheduled)
        step = self.speculation.new_step(len(self.running)) if self.speculation is not None else None
        running, schedulable, allocate = self.running, self._num_schedulable, self.kv.allocate  # per request per step
        while i < len(running) and len(scheduled) < max_seqs:
            req = running[i]
            num_new = min(schedulable(req), budget)
            if num_new == 0 or (taken and req.request_id in taken):
                i += 1
                continue
            while not allocate(req, num_new):
                victim = self._preempt({r.request_id for r, _, _ in scheduled}, asking=req)
                if victim is None:  # every newer request is in flight: wait for one to come back
                    i += 1
                    break
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new, []))
                budget -= num_new
                i += 1
        if step is None:
            return budget
        # Each request's drafts are weighed against the rows of those scheduled before it (theirs included).
        for j in range(first, len(scheduled)):
            req, num_new, _ = scheduled[j]
            draft = self._fit_draft(req, self._draft(req, budget, step)) if num_new == 1 else []
            if draft:
                self.speculation.join(req, draft, step)
                scheduled[j] = (req, num_new, draft)
                budget -= len(draft)
        return budget

    def _fit_draft(self, req: Request, draft: list[int]) -> list[int]:
        """As much of `req`'s draft as the slots of its blocks and the free ones hold, allocated (after its token)."""
        if not draft or self.kv.allocate(req, 1 + len(draft)):
            return draft
        room = (len(req.block_table) + self.kv.num_free_blocks) * self.kv.block_size - req.num_scheduled_tokens - 1
        draft = draft[: max(0, room)]
        return draft if draft and self.kv.allocate(req, 1 + len(draft)) else []

    def _admit_waiting(
        self, scheduled: list[tuple[Request, int, list[int]]], max_seqs: int, budget: int, num_running_at_start: int
    ) -> int:
        """Waiting requests in the policy's order, while they fit. Returns the budget left."""
        pending = self._blocks_being_computed() if self.waiting and self.kv.prefix_caching else set()
        while (
            self.waiting
            and len(scheduled) < max_seqs
            and len(self.running) < self.max_running
            and self.admission.may_admit(num_running_at_start, budget)
        ):
            req = self.waiting.first
            # Mean pooling needs every prompt row's hidden state, so it computes the prompt whole.
            whole = req.needs_prompt_logprobs or req.params.pooling == "mean"
            req.num_computed_tokens = 0 if whole else self.kv.take_cached_prefix(req)
            # A running request may be computing the next block of this prompt (a sibling choice of an n > 1
            # request, a shared system prompt): then wait an iteration or two and take it from the cache.
            following = len(req.block_table)
            waits = following < len(req.block_names) and req.block_names[following] in pending
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if waits or not self._blocks_for_newcomer(req, num_new, {r.request_id for r, _, _ in scheduled}):
                self.kv.free(req)  # the prefix it took stays cached for its next try
                req.num_computed_tokens = 0
                break  # in the policy's order: nobody overtakes a request that waits or does not fit
            self.prefix_queried_tokens += req.num_tokens
            self.prefix_hit_tokens += req.num_computed_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                req.queue_seconds = time.monotonic() - req.arrival_time
            self.waiting.pop_first()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            pending.update(req.block_names[req.num_registered_blocks :])
            if num_new:
                scheduled.append((req, num_new, []))
                budget -= num_new
        return budget

    def _newcomers_alone(self) -> bool:
        """Whether this iteration computes new prompts only (the policy's NEWCOMERS_ALONE), so their first tokens
        wait for no decode; never twice in a row, so the running requests take at least every other iteration."""
        if not self.policy.NEWCOMERS_ALONE or self.newcomers_ran_alone or not self.waiting or not self.running:
            return False
        return self.waiting.first.num_output_tokens == 0 and len(self.running) < self.max_running

    def _running_slots(self, max_seqs: int) -> int:
        """Of an iteration's `max_seqs` requests, how many running ones take: all, unless more hold blocks than run
        and waiting ones key before some of them (then those newcomers are admitted in their place)."""
        if not self.reorders or not self.waiting:
            return max_seqs
        room = min(self.max_running - len(self.running), max_seqs)
        newcomers = [(self.policy.key(r), 1) for r, _ in zip(self.waiting, range(room))]
        ready = [(self.policy.key(r), 0) for r in self.running if self._num_schedulable(r)]
        return max_seqs - sum(waiting for _, waiting in sorted(ready + newcomers)[:max_seqs])

    def _draft(self, req: Request, budget: int, step: StepDrafts) -> list[int]:
        """Draft tokens for a request scheduled to decode one token, if speculation is on and it is not running ahead:
        never more than its max_tokens, the context window or what the step's token budget has left (`budget`)."""
        if self.speculation is None or req.request_id in self.in_flight or req.num_output_tokens == 0:
            return []
        if req.params.seed is not None and not req.params.greedy:
            return []  # its draws would follow its drafts, which follow the batch: a seed gives the same tokens anywhere
        limit = min(budget, req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
        return self.speculation.draft(req, limit, step)

    def _num_schedulable(self, req: Request) -> int:
        """Tokens a running request could compute next: what it has, or (running ahead) the one token the batch
        in flight samples for it, unless that token may end it or its sampling must see that token first."""
        # Per running request per step: lengths and counters read directly, not through properties.
        in_flight = self.in_flight.get(req.request_id)
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if not in_flight:
            return num_tokens - req.num_computed_tokens
        if not self.run_ahead or in_flight > 1 or req.request_id in self.drafting:
            return 0
        # One that may run several steps waits for its check-in instead: its next batch can run them only once
        # nothing is in flight.
        if self.check_in_steps > 1 and not self.waiting and self.policy.runs_long(req):
            return 0
        pending = req.num_pending_outputs
        # Not ahead of a token its sampling must see, nor of one that may reach max_tokens or the context window (a
        # stop id can end it anyway: that costs one wasted row, which update drops).
        if pending and (
            req.reads_own_outputs
            or len(req.output_token_ids) + pending >= req.params.max_tokens
            or num_tokens + pending >= self.max_model_len
        ):
            return 0
        return num_tokens + pending - req.num_computed_tokens - req.num_in_flight_tokens

    def _blocks_being_computed(self) -> set[bytes]:
        """Prefix-cache names of the full blocks that running requests have yet to compute."""
        return {name for r in self.running for name in r.block_names[r.num_registered_blocks :]}

    def _to_scheduled(self, req: Request, num_new: int, draft: list[int]) -> ScheduledRequest:
        """`req`'s share of the batch, counted in flight."""
        start = req.num_computed_tokens + req.num_in_flight_tokens
        end = start + num_new
        num_prompt = len(req.prompt_token_ids)
        known = num_prompt + len(req.output_token_ids)
        prompt_rows = None
        if num_new == 1 and start >= num_prompt:  # a decode step: one output token, or the one in flight
            token_ids = [req.output_token_ids[start - num_prompt]] if start < known else [PLACEHOLDER]
        else:
            token_ids = req.token_ids(start, min(end, known))
            if end > known:
                token_ids += [PLACEHOLDER] * (end - max(start, known))
            # The optional parts are asked for only where they can be there: this runs per request per step.
            if req.params.prompt_logprobs is not None:
                prompt_rows = self._prompt_logprob_rows(req, start, end)
        sample = end == known + req.num_pending_outputs
        probe = sample and self.policy.probing and self.policy.probes(req)
        if draft:
            token_ids += draft
            self.drafting.add(req.request_id)
        rid = req.request_id
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        req.num_in_flight_tokens += len(token_ids)
        req.num_pending_outputs += sample
        req.num_sent_tokens = start + len(token_ids)
        # Only the blocks no batch carried yet: the runners hold the others (engine/runner/input_batch.py).
        table, sent = req.block_table, req.num_sent_blocks
        if len(table) != sent:
            req.num_sent_blocks = len(table)
            table = table[sent:]
        else:
            table = []
        return ScheduledRequest(
            rid,
            token_ids,
            start,
            table,
            sample,
            prompt_rows,
            len(draft),
            probe,
            sent,
            req.params.pooling if start < num_prompt else "",
        )

    def _columnar(self, scheduled: list[tuple[Request, int, list[int]]], batch: Batch) -> None:
        """Put `scheduled` in `batch`: plain decode rows as columns (Batch.decode), the others as ScheduledRequests."""
        structs, d = batch.requests, batch.decode
        ids, tokens, moved, positions = d.request_ids, d.token_ids, d.moved, d.positions
        in_flight, probing, probes = self.in_flight, self.policy.probing, self.policy.probes
        # Per request per step: the test and the bookkeeping of _to_scheduled for one token, inlined.
        for req, num_new, draft in scheduled:
            start = req.num_computed_tokens + req.num_in_flight_tokens
            num_prompt = len(req.prompt_token_ids)
            known = num_prompt + len(req.output_token_ids)
            if (
                num_new != 1
                or draft
                or start < num_prompt
                or start + 1 != known + req.num_pending_outputs  # it does not sample
                or (probing and probes(req))
            ):
                structs.append(self._to_scheduled(req, num_new, draft))
                continue
            rid = req.request_id
            i = len(ids)
            ids.append(rid)
            tokens.append(req.output_token_ids[start - num_prompt] if start < known else PLACEHOLDER)
            if start != req.num_sent_tokens:
                moved.append(i)
                positions.append(start)
            req.num_sent_tokens = start + 1
            in_flight[rid] = in_flight.get(rid, 0) + 1
            req.num_in_flight_tokens += 1
            req.num_pending_outputs += 1
            table, sent = req.block_table, req.num_sent_blocks
            if len(table) != sent:
                d.grown.append(i)
                d.block_offsets.append(sent)
                d.blocks.append(table[sent:])
                req.num_sent_blocks = len(table)

    @staticmethod
    def _prompt_logprob_rows(req: Request, start: int, end: int) -> PromptLogprobRows | None:
        """Rows of the chunk [start, end) that give prompt logprobs not yet asked of an earlier chunk (a request
        computed again after a preemption has its earlier ones)."""
        if req.params.prompt_logprobs is None:
            return None
        lo, hi = max(start, req.num_prompt_logprob_rows), min(end, req.num_prompt_tokens - 1)
        if hi <= lo:
            return None
        req.num_prompt_logprob_rows = hi
        return PromptLogprobRows(lo - start, req.prompt_token_ids[lo + 1 : hi + 1], req.params.prompt_logprobs)

    def _make_room(self, budget: int) -> None:
        """Before running requests take this iteration's blocks: where the first waiting request's first chunk would
        not fit, running requests that rank after it give theirs up, highest first (the `predicted` policy)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return
        first = self.waiting.first
        needed = self.kv.blocks_for(min(first.num_tokens, budget))  # as if nothing were cached: at worst, one too many
        while self.kv.num_free_blocks < needed:
            if self._preempt(set(), above=self.policy.rank(first)) is None:
                return

    def _blocks_for_newcomer(self, req: Request, num_new: int, scheduled: set[str]) -> bool:
        """Blocks for a waiting request's first chunk. Where more requests hold blocks than an iteration takes (the
        `predicted` policy), running ones that rank after it give theirs up, highest first, when there are too few."""
        while not self.kv.allocate(req, num_new):
            if not self.reorders:
                return False
            if self._preempt(scheduled, above=self.policy.rank(req)) is None:
                return False
        return True

    def _preempt(
        self, scheduled: set[str], above: float | None = None, asking: Request | None = None
    ) -> Request | None:
        """Free the blocks of a running request not in this batch (`scheduled`) nor in one in flight, of the highest
        rank (above `above`, if given), the newest admitted among equals; None where there is none, or where it would
        be `asking` (the request short of blocks) while one ranking after it is in flight."""
        # Recompute, not swap: the newest request gives up its blocks so older ones keep progressing.
        # One in a batch still in flight is left alone: its tokens are being computed into those blocks.
        rank = self.policy.rank
        candidates = [
            (rank(r), i)
            for i, r in enumerate(self.running)
            if r.request_id not in self.in_flight
            and r.request_id not in scheduled
            and (above is None or rank(r) > above)
        ]
        if not candidates:
            return None
        best = max(candidates)
        victim = self.running[best[1]]
        # The request asking waits for that one to come back rather than give up its own blocks: else, with batches in
        # flight (pipeline stages), two requests could take turns preempting themselves for ever.
        if victim is asking and any(
            (rank(r), i) > best for i, r in enumerate(self.running) if r.request_id in self.in_flight
        ):
            return None
        self.running.remove(victim)
        self.kv.free(victim)
        self.dropped.append(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_sent_tokens = -1  # its row goes: the runners keep no position of it
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(victim)  # in front of everyone who arrived after it (FCFS)
        return victim

    def update(
        self,
        batch: Batch,
        sampled: dict[str, SampledTokens | Failure],
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
        seconds: float | None = None,
    ) -> list[Request]:
        """Account computed tokens, append sampled ones (and the prompt logprobs of chunks that asked for them),
        retire finished requests; returns those that got a token. `seconds`: how long the batch took, if known."""
        # A step of decoding requests only (prompt chunks would swamp it) shows what its rows cost.
        if (
            self.speculation is not None
            and seconds is not None
            and batch.num_steps == 1
            and all(sr.sample and len(sr.token_ids) == sr.num_draft + 1 for sr in batch.requests)
        ):
            self.speculation.step_cost.observe(batch.num_tokens, seconds)
        updated = []
        # Per request per step: the attributes it reads are bound once for the batch.
        in_flight, drafting, requests, kv = self.in_flight, self.drafting, self.requests, self.kv
        names_blocks, block_size, window = kv.prefix_caching, kv.block_size, self.kv_window
        several_steps = batch.num_steps > 1
        for sr in batch.requests:
            rid = sr.request_id
            left = in_flight[rid] - 1
            if left:
                in_flight[rid] = left
            else:
                del in_flight[rid]
            if drafting:
                drafting.discard(rid)
            req = requests.get(rid)
            if req is None:  # aborted, or finished by the batch before (a row scheduled ahead): its token is dropped
                continue
            num_new = len(sr.token_ids)
            req.num_in_flight_tokens -= num_new
            req.num_pending_outputs -= sr.sample
            result = sampled.get(rid)
            if isinstance(result, Failure):  # only this request (or only this batch) goes; its blocks are freed
                req.error = result.message
                self._finish(req, RequestStatus.FINISHED_ERROR)
                updated.append(req)
                continue
            # A rejected draft token's K/V stays in its slot, uncounted (so never named for the prefix cache), until
            # the token that belongs there is computed over it. A run of several steps computed, as inputs, every token
            # it returns but the last, as accepted drafts are.
            num_draft = sr.num_draft
            num_accepted = len(result.token_ids) - 1 if num_draft or several_steps else 0
            req.num_computed_tokens += num_new - num_draft + num_accepted
            if sr.prompt_logprobs is not None:
                req.prompt_logprobs += prompt_logprobs[rid]
            if result is not None and result.hidden is not None:
                self.policy.probed(req, result.hidden)
            if result is not None and result.embedding is not None:
                req.embedding = result.embedding
            status = self._append(req, result) if sr.sample else None
            if names_blocks and req.num_computed_tokens // block_size > req.num_registered_blocks:
                kv.cache_full_blocks(req)
            if window:  # the next query (at num_computed_tokens) sees keys from here on
                kv.release_before(req, req.num_computed_tokens - window + 1)
            if num_draft and self.speculation is not None:
                self.speculation.verified(req, num_draft, num_accepted)
            if status is not None:
                self._finish(req, status)
            if sr.sample:
                updated.append(req)
        if batch.decode.request_ids:
            self._update_decode(batch.decode.request_ids, sampled, updated)
        return updated

    def _update_decode(
        self, request_ids: list[str], sampled: dict[str, SampledTokens | Failure], updated: list
    ) -> None:
        """update() for the plain decode rows: one token computed and one sampled each (no drafts, probes or pooling)."""
        if self.fast_decode:
            update_plain_decodes(self, request_ids, sampled, updated)
            return
        in_flight, drafting, requests = self.in_flight, self.drafting, self.requests
        for rid in request_ids:
            left = in_flight[rid] - 1
            if left:
                in_flight[rid] = left
            else:
                del in_flight[rid]
            if drafting:
                drafting.discard(rid)
            req = requests.get(rid)
            if req is None:  # aborted, or finished by the batch before (a row scheduled ahead): its token is dropped
                continue
            self._update_decode_row(req, sampled[rid], updated)

    def _update_decode_row(self, req: Request, result: SampledTokens | Failure, updated: list) -> None:
        """A plain decode row's update, once its batch no longer counts in flight: _append and _check_stop for one
        token, inlined."""
        req.num_in_flight_tokens -= 1
        req.num_pending_outputs -= 1
        if type(result) is not SampledTokens:  # a Failure: only this request goes; its blocks are freed
            req.error = result.message
            self._finish(req, RequestStatus.FINISHED_ERROR)
            updated.append(req)
            return
        kv, window = self.kv, self.kv_window
        computed = req.num_computed_tokens = req.num_computed_tokens + 1
        outputs, params = req.output_token_ids, req.params
        token_id = result.token_ids[0]
        outputs.append(token_id)
        if result.logprobs is not None:
            req.output_logprobs.append(result.logprobs[0])
        n = len(outputs)
        if token_id in req.stop_token_ids and n >= params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
        elif n >= params.max_tokens or len(req.prompt_token_ids) + n >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        else:
            status = None
        if status is not None:
            computed = req.num_computed_tokens = min(computed, len(req.prompt_token_ids) + n - 1)
        if kv.prefix_caching and computed // kv.block_size > req.num_registered_blocks:
            kv.cache_full_blocks(req)
        if window:  # the next query (at num_computed_tokens) sees keys from here on
            kv.release_before(req, computed - window + 1)
        if status is not None:
            self._finish(req, status)
        updated.append(req)

    def _append(self, req: Request, result: SampledTokens) -> RequestStatus | None:
        """Append a step's tokens up to the first that ends the request (those after it are dropped)."""
        logprobs = result.logprobs
        for i, token_id in enumerate(result.token_ids):
            req.output_token_ids.append(token_id)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            status = self._check_stop(req, token_id)
            if status is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                return status
        return None

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        num_outputs, params = len(req.output_token_ids), req.params
        if token_id in req.stop_token_ids and num_outputs >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_outputs >= params.max_tokens or len(req.prompt_token_ids) + num_outputs >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if status != RequestStatus.FINISHED_ERROR:
            if self.speculation is not None:
                self.speculation.finished(req)
            self.policy.finished(req)
        req.status = status
        self.running.remove(req)
        self.kv.free(req)
        self.dropped.append(req.request_id)
        del self.requests[req.request_id]
