"""The scheduler driven at random against a fake device that keeps every KV slot's contents (no model): arrivals with
shared prefixes and salts, aborts (of requests in flight too), preemption, drafts, check-in runs, sliding windows, the
queue policies, failures. After every schedule and update: block ownership, the prefix cache, counters, in-flight rules;
and the device checks that every key a row reads holds the K/V of that request's own tokens.

`python tests/test_scheduler_invariants.py FIRST LAST [STEPS]` sweeps seeds with random settings."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from engine.core.batch import PLACEHOLDER, Batch
from engine.core.config import EngineConfig
from engine.core.queue_policy import Predicted
from engine.core.request import Failure, Request, RequestOptions, RequestStatus, SampledTokens, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.speculation import Speculation
from engine.runner.input_batch import InputBatch

EOS = 0
VOCAB = 12  # few token ids: stop ids are hit and prompts share prefixes


class Violation(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise Violation(msg)


class RandomDrafts:
    """A draft source whose drafts are random tokens (the device accepts a random number of them)."""

    matched = 3

    def __init__(self, rng):
        self.rng = rng

    def new_drafters(self, salt):
        return [self]

    def propose(self, tokens, k):
        return [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randrange(0, k + 1))]

    def finished(self, output_token_ids, salt):
        pass


class RandomLengths:
    """A length predictor that says nothing now and then, and random lengths otherwise."""

    def __init__(self, rng):
        self.rng = rng

    def predict(self, hidden, num_output_tokens):
        return None if self.rng.random() < 0.2 else float(self.rng.randrange(1, 200))

    def observe(self, probes, num_output_tokens):
        pass

    def save(self):
        pass


def prefix_hashes(tokens: list[int]) -> list[int]:
    """What the K/V at each position depends on: every token up to it."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FakeDevice:
    """Runs each batch when it is submitted (stages run batches in that order) through the runner's real persistent
    batch: checks that every key a row reads holds the K/V of its request's own tokens and that its block table is the
    scheduler's, writes its rows' K/V, and samples random tokens (drafts accepted at random, rejected ones left in
    their slots)."""

    def __init__(self, sched: Scheduler, rng: random.Random, max_model_len: int, fail_rate: float):
        self.s = sched
        self.rng = rng
        self.bs = sched.kv.block_size
        self.slots = [[None] * self.bs for _ in range(sched.kv.num_blocks)]
        self.input = InputBatch(max_blocks=max_model_len // self.bs + 2)
        self.sampled: dict[str, dict[int, int]] = {}  # request -> position -> token the device sampled there
        self.failed: set[str] = set()  # its sampling failed: a row run ahead of it has no token (update drops it)
        self.max_model_len = max_model_len
        self.fail_rate = fail_rate

    def forget(self, rid: str) -> None:
        self.sampled.pop(rid, None)
        self.failed.discard(rid)

    def tokens(self, req: Request, end: int) -> list[int]:
        """The request's first `end` tokens: those the host knows, then those the device sampled ahead of it."""
        toks = (req.prompt_token_ids + req.output_token_ids)[:end]
        dev = self.sampled.get(req.request_id, {})
        for p in range(len(toks), end):
            check(p in dev, f"{req.request_id}: position {p} neither known nor sampled")
            toks.append(dev[p])
        return toks

    def run(self, batch: Batch) -> tuple[dict, dict]:
        s = self.s
        rows = self.input.apply(batch)
        items = [
            (sr.request_id, sr.num_computed_tokens, sr.token_ids, sr.num_draft, sr.sample, sr) for sr in batch.requests
        ]
        d = batch.decode
        for i, rid in enumerate(d.request_ids):
            items.append((rid, int(self.input.decode_positions[i]), [d.token_ids[i]], 0, True, None))
        result, prompt_logprobs = {}, {}
        for (rid, start, token_ids, num_draft, sample, sr), row in zip(items, rows):
            req = s.requests[rid]
            if rid in self.failed:
                if sample:
                    result[rid] = Failure("after a failure")
                continue
            table = [int(b) for b in self.input.block_tables[row, : self.input.lengths[row]]]
            check(
                table == req.block_table, f"{rid}: the runner's table {table} is not the scheduler's {req.block_table}"
            )
            if sample and self.rng.random() < self.fail_rate:
                result[rid] = Failure("injected")
                self.failed.add(rid)
                continue
            out = self._run_row(req, table, start, token_ids, num_draft, sample, batch.num_steps)
            if sr is not None and sr.prompt_logprobs is not None:
                prompt_logprobs[rid] = [TokenLogprobs(t, -1.0, []) for t in sr.prompt_logprobs.targets]
            if sample:
                logprobs = [TokenLogprobs(t, -1.0, []) for t in out] if req.params.logprobs is not None else None
                hidden = [0.5] if sr is not None and sr.probe else None
                embedding = [1.0] if sr is not None and sr.pooling else None
                result[rid] = SampledTokens(out, logprobs, hidden, embedding)
        return result, prompt_logprobs

    def _run_row(self, req, table, start, token_ids, num_draft, sample, num_steps) -> list[int]:
        rid, kv, window = req.request_id, self.s.kv, self.s.kv_window
        dev = self.sampled.setdefault(rid, {})
        inputs = []
        for i, t in enumerate(token_ids):
            if t == PLACEHOLDER:
                check(start + i in dev, f"{rid}: a placeholder at {start + i}, where nothing was sampled")
                t = dev[start + i]
            inputs.append(t)
        num_known = len(inputs) - num_draft
        true = self.tokens(req, start) + inputs[:num_known]
        check(self.tokens(req, start + num_known) == true, f"{rid}: the row's tokens are not the request's")
        out = []
        for step in range(num_steps):
            end = start + len(inputs)
            hashes = prefix_hashes(true + inputs[num_known:])
            for q in range(max(0, start - window + 1) if window else 0, start):
                b = table[q // self.bs]
                check(kv.ref_counts[b] > 0, f"{rid}: reads position {q} from block {b}, which nobody holds")
                check(self.slots[b][q % self.bs] == hashes[q], f"{rid}: position {q} in block {b} holds other K/V")
            for q in range(start, end):
                check(q // self.bs < len(table), f"{rid}: writes position {q} past its {len(table)} blocks")
                b = table[q // self.bs]
                check(kv.ref_counts[b] > 0, f"{rid}: writes block {b}, which nobody holds")
                self.slots[b][q % self.bs] = hashes[q]
            if not sample:
                return out
            accepted = inputs[num_known : num_known + self.rng.randint(0, num_draft)] if num_draft else []
            stops = sorted(req.stop_token_ids)
            nxt = self.rng.choice(stops) if stops and self.rng.random() < 0.05 else self.rng.randrange(1, VOCAB)
            for i, t in enumerate([*accepted, nxt]):
                dev[start + num_known + i] = t
            out += [*accepted, nxt]
            # A later step of a check-in run feeds the sampled token back, unless it ended the row.
            num_outputs, p = len(req.output_token_ids) + len(out), req.params
            if (
                step + 1 == num_steps
                or (nxt in req.stop_token_ids and num_outputs >= p.min_tokens)
                or num_outputs >= p.max_tokens
                or len(req.prompt_token_ids) + num_outputs >= self.max_model_len
            ):
                return out
            true, start, inputs, num_known, num_draft = true + [nxt], end, [nxt], 1, 0
        return out


def make_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    n = rng.choice([1, 2, 3, 5, 8, 13, 20, 33, 50])
    if prefixes and rng.random() < 0.6:
        p = rng.choice(prefixes)
        return p[: rng.randrange(1, len(p) + 1)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, n + 1))]
    p = [rng.randrange(1, VOCAB) for _ in range(n)]
    if rng.random() < 0.3:
        prefixes.append(p)
    return p


def make_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.choice([1, 1, 2, 3, 5, 8, 20, 40])
    kw = {"max_tokens": max_tokens, "min_tokens": rng.randint(0, max_tokens) if rng.random() < 0.3 else 0}
    for chance, extra in [
        (0.3, {"stop_token_ids": (rng.randrange(1, VOCAB),)}),
        (0.1, {"ignore_eos": True}),
        (0.5, {"temperature": 0.0}),
        (0.1, {"presence_penalty": 0.5}),
        (0.05, {"prompt_logprobs": 1}),
        (0.1, {"seed": 3}),
        (0.05, {"grammar": "any"}),  # the scheduler only asks whether there is one
        (0.1, {"logprobs": 1}),
        (0.05, {"prompt_only": True, "max_tokens": 1, "min_tokens": 0, "pooling": rng.choice(["last", "mean"])}),
    ]:
        if rng.random() < chance:
            kw.update(extra)
    return SamplingParams(**kw)


def check_state(s: Scheduler, inflight: list[Batch]) -> None:
    kv = s.kv
    holders = Counter()
    for rid, req in s.requests.items():
        if req.status == RequestStatus.WAITING:
            check(not req.block_table, f"{rid} waits holding blocks {req.block_table}")
        else:
            check(req.status == RequestStatus.RUNNING, f"{rid} is in the scheduler with status {req.status}")
            slots = len(req.block_table) * kv.block_size
            check(req.num_scheduled_tokens <= slots, f"{rid}: {req.num_scheduled_tokens} tokens in {slots} slots")
        holders.update(req.block_table[req.num_released_blocks :])
        check(
            req.num_computed_tokens <= req.num_tokens, f"{rid}: {req.num_computed_tokens} of {req.num_tokens} computed"
        )
        check(
            req.num_registered_blocks * kv.block_size <= req.num_computed_tokens or not req.block_table,
            f"{rid}: {req.num_registered_blocks} blocks named, {req.num_computed_tokens} tokens computed",
        )
    for b in range(kv.num_blocks):
        check(kv.ref_counts[b] == holders[b], f"block {b}: ref count {kv.ref_counts[b]}, {holders[b]} holders")
        check((b in kv.free_queue) == (holders[b] == 0), f"block {b}: {holders[b]} holders, free: {b in kv.free_queue}")
    check(all(kv.block_names.get(b) == name for name, b in kv.cached.items()), "cache names and blocks disagree")
    check(len(kv.cached) == len(kv.block_names), "cache names and blocks disagree")
    running, waiting = [r.request_id for r in s.running], [r.request_id for r in s.waiting]
    check(len(set(running + waiting)) == len(running) + len(waiting), "a request twice in the queues")
    check(set(running + waiting) == set(s.requests), "the queues are not the scheduler's requests")
    check((s.num_running, s.num_waiting) == (len(running), len(waiting)), "counters")
    check(len(running) <= s.max_running, f"{len(running)} hold blocks, more than {s.max_running}")
    expected = Counter(rid for batch in inflight for rid in batch.request_ids)
    check(expected == +s.in_flight, f"in flight: {dict(s.in_flight)}, batches say {dict(expected)}")
    for rid, req in s.requests.items():
        check(expected[rid] <= (2 if s.run_ahead else 1), f"{rid} is in {expected[rid]} batches in flight")
        if not expected[rid]:
            check(req.num_in_flight_tokens == req.num_pending_outputs == 0, f"{rid}: in-flight counters left")


def check_names(s: Scheduler, device: FakeDevice, names: dict) -> None:
    """Every block the prefix cache names holds the K/V of the tokens its name stands for."""
    bs = s.kv.block_size
    for req in s.requests.values():
        hashes = prefix_hashes(req.token_ids(0, len(req.block_names) * bs))
        for i, name in enumerate(req.block_names):
            names[name] = hashes[i * bs : (i + 1) * bs]
    for name, b in s.kv.cached.items():
        check(name not in names or device.slots[b] == names[name], f"block {b} is named, but holds other K/V")


def check_batch(s: Scheduler, batch: Batch, inflight: list[Batch]) -> None:
    check(batch.num_tokens <= s.config.max_num_batched_tokens, f"{batch.num_tokens} tokens: over the budget")
    check(len(batch) <= s.config.max_num_seqs, f"{len(batch)} rows, more than max_num_seqs")
    check(len(set(batch.request_ids)) == len(batch), "a request twice in one batch")
    for earlier in inflight:
        both = set(earlier.request_ids) & set(batch.request_ids)
        check(not both or s.run_ahead, f"{both} in two batches in flight without async scheduling")
        several = {r.request_id for r in earlier.requests if r.num_draft or earlier.num_steps > 1}
        check(not both & several, f"{both & several} scheduled ahead of a batch that may give them several tokens")


def run(seed: int, steps: int, **pinned) -> Scheduler:
    """`steps` iterations of random arrivals and aborts, then a drain; settings random but for those `pinned`."""
    rng = random.Random(seed)

    def pick(name, choices):
        return pinned[name] if name in pinned else rng.choice(choices)

    bs, max_model_len = pick("block_size", [2, 4, 8]), pick("max_model_len", [64, 128])
    policy_name = pick("policy", ["fcfs", "priority", "predicted"])
    config = EngineConfig(
        block_size=bs,
        max_num_batched_tokens=pick("max_num_batched_tokens", [8, 16, 32, 64]),
        max_num_seqs=pick("max_num_seqs", [2, 4, 8]),
        async_scheduling=pick("async_scheduling", ["on", "off"]),
        prefix_caching=pick("prefix_caching", [True, True, True, False]),
        check_in_steps=pick("check_in_steps", [1, 1, 4]),
        scheduling_policy="fcfs" if policy_name == "predicted" else policy_name,
        kv_policy=pick("kv_policy", ["paged"] * 9 + ["orca-reserve"]),
        scheduling=pick("scheduling", ["iteration"] * 9 + ["request"]),
    )
    num_blocks = pick("num_blocks", [max_model_len // bs + 2, 2 * max_model_len // bs, 100])
    window = pick("window", [None, None, 8, 20])
    spec = Speculation(RandomDrafts(rng), max_tokens=4, row_cost=0.01) if pick("speculation", [0, 0, 1]) else None
    policy = Predicted(pick("predictor", [None, RandomLengths(rng)])) if policy_name == "predicted" else None
    s = Scheduler(config, num_blocks, max_model_len, kv_window=window, speculation=spec, policy=policy)
    s.columnar_decode = pick("columnar_decode", [True, True, False])
    s.fast_decode = pick("fast_decode", [True, True, True, False])
    # Async scheduling runs one process: two batches in flight; pipeline stages, one per stage.
    max_in_flight = 2 if config.async_scheduling == "on" else pick("max_in_flight", [1, 1, 2, 3])
    device = FakeDevice(s, rng, max_model_len, fail_rate=0.002)
    inflight: deque[tuple[Batch, dict, dict]] = deque()
    prefixes: list[list[int]] = []
    gone: list[str] = []
    names: dict = {}
    num_arrived = idle = 0
    for it in range(10 * steps):
        arriving = it < steps
        if not arriving and not inflight and not s.has_unfinished():
            break
        for _ in range(rng.choice([0, 0, 1, 1, 3]) if arriving else 0):
            prompt, params = make_prompt(rng, prefixes), make_params(rng)
            total = len(prompt) + params.output_room
            held = min(total, window + config.max_num_batched_tokens + 2 * bs) if window else total
            if total > max_model_len or -(-held // bs) > num_blocks:
                continue  # RequestLimits turns it away
            rid = f"r{num_arrived}"
            if gone and rng.random() < 0.05 and gone[-1] not in s.in_flight:  # an id used again (EngineCore's rule)
                rid = gone.pop()
            device.forget(rid)
            options = RequestOptions(cache_salt=rng.choice([b"", b"", b"a", b"b"]), priority=rng.randint(0, 3))
            s.add(Request(rid, prompt, params, float(it), EOS, options))
            num_arrived += 1
        if arriving and s.requests and rng.random() < 0.05:
            flying = sorted(rid for rid in s.in_flight if rid in s.requests)  # half the time, one in a batch in flight
            gone.append(s.abort(rng.choice(flying if flying and rng.random() < 0.5 else sorted(s.requests))).request_id)
        check_state(s, [b for b, _, _ in inflight])
        while len(inflight) < max_in_flight:
            batch = s.schedule(num_batches=max_in_flight - len(inflight))
            if not len(batch):
                break
            check_batch(s, batch, [b for b, _, _ in inflight])
            inflight.append((batch, *device.run(batch)))
            check_state(s, [b for b, _, _ in inflight])
        # An iteration may only preempt (for a newcomer that then is not admitted); the next must run something.
        idle = 0 if inflight or not s.has_unfinished() else idle + 1
        check(idle < 2, f"stuck: {s.num_waiting} waiting, {s.num_running} running, nothing scheduled")
        if not inflight:
            continue
        batch, sampled, prompt_logprobs = inflight.popleft()
        for req in s.update(batch, sampled, prompt_logprobs):
            if req.status.finished:
                gone.append(req.request_id)
                check(not req.block_table, f"{req.request_id} finished holding blocks")
                if req.status != RequestStatus.FINISHED_ERROR:
                    check(req.num_output_tokens <= req.params.max_tokens, f"{req.request_id}: too many outputs")
                    n = req.num_output_tokens if req.params.logprobs is not None else 0
                    check(len(req.output_logprobs) == n, f"{req.request_id}: logprobs of {n} outputs")
                    n = req.num_prompt_tokens - 1 if req.params.prompt_logprobs is not None else 0
                    check(len(req.prompt_logprobs) == n, f"{req.request_id}: prompt logprobs of {n} tokens")
        check_state(s, [b for b, _, _ in inflight])
        check_names(s, device, names)
    check(not s.has_unfinished() and not s.in_flight, "requests left after the drain")
    check(s.kv.num_free_blocks == s.kv.num_blocks and not any(s.kv.ref_counts), "blocks held after the drain")
    return s


SCENARIOS = {
    "async, aborts in flight, small cache": {
        "async_scheduling": "on",
        "max_in_flight": 2,
        "num_blocks": 34,
        "block_size": 2,
        "policy": "fcfs",
        "window": None,
    },
    "drafts, predicted order, small cache": {
        "policy": "predicted",
        "speculation": 1,
        "async_scheduling": "off",
        "num_blocks": 18,
        "block_size": 4,
        "window": None,
    },
    "async drafts": {"speculation": 1, "async_scheduling": "on", "max_in_flight": 2, "num_blocks": 100},
    "check-ins": {
        "check_in_steps": 4,
        "async_scheduling": "on",
        "max_in_flight": 2,
        "num_blocks": 34,
        "speculation": 0,
    },
    "sliding window": {"window": 8, "num_blocks": 20, "block_size": 4, "prefix_caching": True},
    "priority, stages": {"policy": "priority", "async_scheduling": "off", "max_in_flight": 3, "num_blocks": 34},
    "predicted, small cache": {
        "policy": "predicted",
        "num_blocks": 34,
        "block_size": 2,
        "prefix_caching": True,
        "max_num_seqs": 2,
    },
    "predicted, request level": {"policy": "predicted", "scheduling": "request", "prefix_caching": True},
}


@pytest.mark.parametrize("seed,name", list(enumerate(SCENARIOS)), ids=list(SCENARIOS))
def test_the_scheduler_keeps_its_invariants_at_random(seed, name):
    s = run(seed, 200, **SCENARIOS[name])
    assert s.num_arrived > 100


if __name__ == "__main__":
    import sys

    first, last = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    bad = 0
    for seed in range(first, last):
        try:
            run(seed, steps)
        except Violation as e:
            bad += 1
            print("seed", seed, e, flush=True)
    print(f"{bad} of {last - first} seeds broke an invariant")
