"""Where one prompt's prefill goes, by kind of work (projections, attention, norms, RoPE + K/V write, activation,
LM head, embedding, the rest), per prompt length; each category timed around its modules' calls, as
profile_decode_step does for decode steps. `--clock cpu` (one thread) counts the thread's CPU time: on a shared,
oversubscribed machine the work, not the waits for a core; `--clock process` all threads' CPU time (what several
threads cost beside one).

    python -m bench.offline.profile_prefill_step --model /tmp/llama3.2-1b-q4_k_m.gguf --threads 1 --clock cpu \\
        --tokens 150 500 --out benchmarks/results/models/prefill_profile_llama3.2-1b.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from bench.common import write_report
from bench.offline.profile_decode_step import Timers, instrument
from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine


def prefill(engine, ids: list[int], clock) -> tuple[float, int]:
    """ms of the steps that prefill `ids` (max_tokens 1: the last one samples the first token), and their count."""
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    t0, steps = clock(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (clock() - t0) * 1000, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--tokens", type=int, nargs="+", default=[150, 500])
    ap.add_argument("--prompts", type=int, default=3, help="timed prompts per length")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (unset: torch's default)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu", "process"],
        default="wall",
        help="cpu: the thread's CPU time (1 thread); process: the CPU time of all its threads",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the token budget (unset: the default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts one thread's time: pass --threads 1")
    clock = {"wall": time.perf_counter, "cpu": time.thread_time, "process": time.process_time}[args.clock]
    config = EngineConfig(
        model=args.model,
        max_num_seqs=1,
        speculative="off",
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = build_engine(config)
    seed = iter(range(10**6))

    def prompt(n: int) -> list[int]:  # fresh ids each time: no prefix-cache hit
        s = next(seed)
        return [1000 + (s * 7919 + j * 7) % 20000 for j in range(n)]

    prefill(engine, prompt(64), clock)  # warm-up
    plain = {
        n: statistics.median(prefill(engine, prompt(n), clock)[0] for _ in range(args.prompts)) for n in args.tokens
    }
    timers = Timers(clock)
    instrument(engine, timers)
    results = {}
    for n in args.tokens:
        per = collections.defaultdict(list)
        totals, steps = [], 0
        for _ in range(args.prompts):
            timers.reset()
            ms, steps = prefill(engine, prompt(n), clock)
            totals.append(ms)
            for k, v in timers.reset().items():
                per[k].append(v * 1000)
        split = {k: statistics.median(v) for k, v in per.items()}
        split["the rest (glue, residual adds, runner, scheduler, sampler)"] = max(
            0.0, statistics.median(totals) - sum(split.values())
        )
        total = sum(split.values())
        results[str(n)] = {
            "prefill_ms": plain[n],
            "ms_per_token": plain[n] / n,
            "steps": steps,
            "split_ms": dict(sorted(split.items(), key=lambda kv: -kv[1])),
            "share": {k: v / total for k, v in sorted(split.items(), key=lambda kv: -kv[1])},
        }
        print(f"{n} tokens: {plain[n]:.0f} ms ({plain[n] / n:.2f} ms/token) in {steps} step(s)")
        for k, v in results[str(n)]["split_ms"].items():
            print(f"  {k:<60}{v:9.1f} ms {v / total:6.1%}")
    report = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "load_average": os.getloadavg(),  # the machine is shared: what else ran, over 1, 5 and 15 minutes
        "results": results,
    }
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
