"""bench_length_aware's `--null-model` runs: the real engine (scheduler, paged KV cache, queue policies) with a model
that computes nothing, on a simulated clock where each step costs a fixed formula of its rows, so two policies given
the same arrivals differ only by their order, whatever else runs on the machine.

Requests are eval_length_predictor's held-out rows (its report's `held_out_rows`): the bundled model's real prompt
and output lengths for the mixed workload, the client's max_tokens, and the trained predictor's prediction from the
prompt. Each request decodes exactly its real length (ignore_eos, max_tokens set to it); the policies read the
client's max_tokens and the prediction from `TABLE`, never the engine's max_tokens. `predicted` here keeps its
prompt-time prediction (the served policy refines it every 16 outputs); `oracle` knows the real length.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import dataclass

from engine.core.queue_policy import Predicted, register_policy
from engine.core.request import Request, RequestStatus

# request id -> (the client's max_tokens, the predictor's prompt-time prediction, the real output length)
TABLE: dict[str, tuple[int, float, int]] = {}


class NullPredicted(Predicted):
    """`predicted` with each request's recorded prompt-time prediction, bounded by the client's max_tokens."""

    @staticmethod
    def remaining(req: Request) -> float:
        max_tokens, predicted, _ = TABLE[req.request_id]
        left = max_tokens - req.num_output_tokens
        return max(1.0, min(float(left), predicted - req.num_output_tokens))


class NullOracle(Predicted):
    """`predicted` told the real length: the ceiling of the order."""

    @staticmethod
    def remaining(req: Request) -> float:
        return max(1.0, float(TABLE[req.request_id][2] - req.num_output_tokens))


POLICIES = {
    "fcfs": "fcfs",
    "predicted": "bench.serving.length_null:predicted",
    "oracle": "bench.serving.length_null:oracle",
}
register_policy(POLICIES["predicted"], NullPredicted)
register_policy(POLICIES["oracle"], NullOracle)


@dataclass(frozen=True)
class StepCost:
    """A step's simulated seconds: fixed, plus per decoding request, plus per prompt token (prefill or recompute)."""

    fixed_ms: float
    decode_row_ms: float
    prompt_token_ms: float

    def seconds(self, decodes: int, prompt_tokens: int) -> float:
        return (self.fixed_ms + self.decode_row_ms * decodes + self.prompt_token_ms * prompt_tokens) / 1e3

    def alone(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's end-to-end seconds with the engine to itself: its prefill step, then one decode per token."""
        return self.seconds(0, prompt_tokens) + (output_tokens - 1) * self.seconds(1, 0)


class SimClock:
    """Stands in for the `time` module where the engine reads the time (arrivals, queue waits)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def held_out_rows(path: str) -> list[dict]:
    rows = json.load(open(path))["held_out_rows"]
    return [r for r in rows if r["predicted"] is not None]


CHECKPOINT = None  # dummy:tiny, loaded once: its weights are never run


class NullEngine:
    """The engine under one policy, its model swapped for fixed logits, its clock simulated."""

    def __init__(self, policy: str, num_blocks: int, cost: StepCost, max_num_seqs: int):
        from bench.offline.null_engine import use_null_model
        from engine.core import engine_core, scheduler
        from engine.core.config import EngineConfig
        from engine.launch import build_engine

        global CHECKPOINT
        if CHECKPOINT is None:
            from engine.model.loader import load_checkpoint

            CHECKPOINT = load_checkpoint("dummy:tiny")
        self.clock, self.cost = SimClock(), cost
        engine_core.time = scheduler.time = self.clock  # the engine's only readers of the time
        # One engine first to learn a block's bytes, then one with `num_blocks` of them.
        config = EngineConfig(
            model="dummy:tiny",
            device="cpu",
            speculative="off",
            max_num_seqs=max_num_seqs,
            scheduling_policy=POLICIES[policy],
            kv_cache_memory=2**22,
            num_threads=1,  # the host's work is not timed: one thread only spares the machine
        )
        probe = build_engine(config, CHECKPOINT)
        block_bytes = config.kv_cache_memory // probe.scheduler.kv.num_blocks
        probe.close()
        self.engine = build_engine(config.with_(kv_cache_memory=block_bytes * num_blocks), CHECKPOINT)
        assert self.engine.scheduler.kv.num_blocks == num_blocks, self.engine.scheduler.kv.num_blocks
        use_null_model(self.engine)
        self.last_batch = None
        submit = self.engine.executor.submit

        def recording_submit(batch, reqs):
            self.last_batch = batch
            return submit(batch, reqs)

        self.engine.executor.submit = recording_submit
        self.ids = 0
        self.prompt_tokens_computed = 0  # prefills, and recomputes after preemptions

    def add(self, at: float, row: dict, rng: random.Random) -> Request:
        from engine import SamplingParams
        from engine.core.request import EngineRequest

        self.ids += 1
        rid = f"r{self.ids}"
        TABLE[rid] = (row["max_tokens"], row["predicted"], row["output_tokens"])
        prompt = [rng.randrange(10, 250) for _ in range(row["prompt_tokens"])]
        params = SamplingParams(max_tokens=row["output_tokens"], temperature=0.0, ignore_eos=True)
        now, self.clock.now = self.clock.now, at  # it arrived at `at`, during the step that ended `now`
        req = self.engine.add_request(EngineRequest(rid, prompt, params))
        self.clock.now = now
        return req

    def step(self) -> list[Request]:
        """One engine step, the clock moved on by its cost."""
        self.last_batch = None
        updated = self.engine.step()
        if self.last_batch is not None:
            # Plain decode rows travel as the batch's columns (Batch.decode), the others as ScheduledRequests.
            decodes = len(self.last_batch.decode) + sum(1 for s in self.last_batch.requests if len(s.token_ids) == 1)
            prompt = sum(len(s.token_ids) for s in self.last_batch.requests if len(s.token_ids) > 1)
            self.clock.now += self.cost.seconds(decodes, prompt)
            self.prompt_tokens_computed += prompt
        return updated

    def close(self) -> None:
        self.engine.close()


def capacity(rows: list[dict], num_blocks: int, cost: StepCost, max_num_seqs: int, warmup: float, seconds: float):
    """FCFS's output tokens per simulated second with a backlog that never empties (closed loop), after `warmup`."""
    eng, rng = NullEngine("fcfs", num_blocks, cost, max_num_seqs), random.Random(99)
    tokens, start = 0, None
    while eng.clock.now < warmup + seconds:
        while eng.engine.scheduler.num_waiting < 16:
            eng.add(eng.clock.now, rng.choice(rows), rng)
        got = len(eng.step())  # one token per request updated: no drafts, one step per call
        if start is not None:
            tokens += got
        elif eng.clock.now >= warmup:
            start = eng.clock.now
    eng.close()
    return tokens / (eng.clock.now - start)


def schedule(rng: random.Random, rows: list[dict], rate: float, seconds: float) -> list[tuple[float, dict]]:
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append((t, rng.choice(rows)))
        t += rng.expovariate(rate)
    return out


def open_loop(policy: str, arrivals, seed: int, num_blocks: int, cost: StepCost, max_num_seqs: int) -> dict:
    """Every arrival sent at its time to a fresh engine under `policy`; each request's latencies, and the queue."""
    eng, rng = NullEngine(policy, num_blocks, cost, max_num_seqs), random.Random(seed)
    reqs, first, done, passed_over = [], {}, {}, set()
    waiting_area = running_area = 0.0  # time integrals of the number waiting and running
    max_waiting, i, host = 0, 0, time.perf_counter()
    sched = eng.engine.scheduler
    while i < len(arrivals) or eng.engine.has_unfinished():
        if not eng.engine.has_unfinished() and eng.clock.now < arrivals[i][0]:
            eng.clock.now = arrivals[i][0]  # idle until the next arrival
        while i < len(arrivals) and arrivals[i][0] <= eng.clock.now:
            reqs.append((arrivals[i][0], eng.add(arrivals[i][0], arrivals[i][1], rng)))
            i += 1
        before, waiting, running = eng.clock.now, list(sched.waiting), sched.num_running
        for r in eng.step():
            first.setdefault(r.request_id, eng.clock.now)
            if r.status.finished:
                done[r.request_id] = eng.clock.now
        # Waiting at a step's start and still waiting after it: passed over, for blocks or for the order.
        passed_over.update(r.request_id for r in waiting if r.status == RequestStatus.WAITING)
        waiting_area += len(waiting) * (eng.clock.now - before)
        running_area += running * (eng.clock.now - before)
        max_waiting = max(max_waiting, len(waiting))
    elapsed = eng.clock.now
    eng.close()
    e2e = sorted(done[r.request_id] - at for at, r in reqs)
    queue = sorted(r.queue_seconds for _, r in reqs)
    ttft = sorted(first[r.request_id] - at for at, r in reqs)
    alone = statistics.fmean(eng.cost.alone(len(r.prompt_token_ids), r.num_output_tokens) for _, r in reqs)
    return {
        "requests": len(reqs),
        "elapsed_s": elapsed,
        "output_tok_s": sum(r.num_output_tokens for _, r in reqs) / elapsed,
        "e2e_mean_s": statistics.fmean(e2e),
        "e2e_p50_s": pct(e2e, 0.5),
        "e2e_p99_s": pct(e2e, 0.99),
        "queue_mean_s": statistics.fmean(queue),
        "queue_p50_s": pct(queue, 0.5),
        "queue_p99_s": pct(queue, 0.99),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": pct(ttft, 0.5),
        "alone_e2e_mean_s": alone,
        "share_passed_over": len(passed_over) / len(reqs),
        "waiting_mean": waiting_area / elapsed,
        "waiting_max": max_waiting,
        "running_mean": running_area / elapsed,
        "preemptions": sched.num_preemptions,
        "requests_preempted": sum(r.num_preemptions > 0 for _, r in reqs),
        # Tokens computed as prompt chunks over the prompts' own: above 1, recomputes (prefix cache hits excepted).
        "prompt_tokens_computed_over_prompts": eng.prompt_tokens_computed
        / sum(len(r.prompt_token_ids) for _, r in reqs),
        "prompt_time_share": eng.prompt_tokens_computed * eng.cost.prompt_token_ms / 1e3 / elapsed,
        "host_s": time.perf_counter() - host,
    }


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def blocks_for(rows: list[dict], contexts: float, block_size: int = 16) -> int:
    """KV blocks that hold `contexts` requests of the rows' mean context (prompt and output), each rounded up."""
    mean_blocks = statistics.fmean(math.ceil((r["prompt_tokens"] + r["output_tokens"]) / block_size) for r in rows)
    return math.ceil(contexts * mean_blocks)


def main(args) -> int:
    """bench_length_aware --null-model: capacity, then rounds of open-loop runs per load, the policies interleaved."""
    from bench.common import write_report

    rows = held_out_rows(args.null_model)
    cost = StepCost(*args.step_cost_ms)
    num_blocks = blocks_for(rows, args.kv_contexts)
    tok_s = capacity(rows, num_blocks, cost, args.max_num_seqs, args.capacity_warmup, args.capacity_seconds)
    mean_output = statistics.fmean(r["output_tokens"] for r in rows)
    rate = tok_s / mean_output
    print(f"{num_blocks} KV blocks; capacity (fcfs): {tok_s:.1f} output tok/s, {rate:.3f} requests/s", flush=True)
    runs: dict = {str(load): {name: [] for name in POLICIES} for load in args.loads}
    for r in range(args.rounds):
        for load in args.loads:
            seed = args.seed_base + 1000 * r + int(100 * load)
            arrivals = schedule(random.Random(seed), rows, load * rate, args.seconds)
            names = list(POLICIES)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = open_loop(name, arrivals, seed, num_blocks, cost, args.max_num_seqs)
                runs[str(load)][name].append(res)
                print(
                    f"round {r} load {load} {name}: e2e mean {res['e2e_mean_s']:.2f} p50 {res['e2e_p50_s']:.2f} "
                    f"p99 {res['e2e_p99_s']:.2f} s; queue mean {res['queue_mean_s']:.2f} p99 {res['queue_p99_s']:.2f} s "
                    f"({res['share_passed_over']:.0%} passed over, {res['waiting_mean']:.1f} waiting on average, "
                    f"{res['running_mean']:.1f} running); {res['preemptions']} preemptions, prompt tokens computed "
                    f"{res['prompt_tokens_computed_over_prompts']:.1f}x the prompts'; {res['requests']} requests",
                    flush=True,
                )
    measures = [k for k, v in next(iter(runs.values()))["fcfs"][0].items() if isinstance(v, (int, float))]
    summary = {
        load: {name: {k: statistics.median(x[k] for x in xs) for k in measures} for name, xs in by.items()}
        for load, by in runs.items()
    }
    # Per round, the same arrivals: the ratio of each policy's mean end-to-end to FCFS's, then its median.
    ratios = {
        load: {
            name: statistics.median(x["e2e_mean_s"] / f["e2e_mean_s"] for x, f in zip(xs, by["fcfs"]))
            for name, xs in by.items()
        }
        for load, by in runs.items()
    }
    for load, by in summary.items():
        print(
            f"load {load}: mean e2e over fcfs's (median of rounds): "
            + ", ".join(f"{name} {ratios[load][name]:.3f}" for name in by),
            flush=True,
        )
    if args.out:
        write_report(
            args.out,
            {
                "null_model": True,
                "policies": POLICIES,
                "rows_from": args.null_model,
                "step_cost_ms": vars(cost),
                "kv_blocks": num_blocks,
                "kv_contexts": args.kv_contexts,
                "max_num_seqs": args.max_num_seqs,
                "capacity_output_tok_s": tok_s,
                "capacity_rate": rate,
                "mean_output_tokens": mean_output,
                "summary": summary,
                "e2e_mean_over_fcfs": ratios,
                "runs": runs,
            },
        )
    return 0
