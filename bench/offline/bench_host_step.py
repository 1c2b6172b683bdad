"""The host side of a decode step alone: schedule -> prepare -> update -> output, no model, two batches in flight.

    python -m bench.offline.bench_host_step --trees . /tmp/wt_base --batch 64 256 --runs 4 \\
        --out benchmarks/results/offline/host_step.json

On a GPU a batch-64 llama-1b decode step was host-bound (docs/performance.md, GPU): this times the Python
that decides it, on any machine. Each tree runs in its own process, the trees interleaved run by run; a run's
figure is the fastest of its rounds (the host code is deterministic: slower rounds are the machine's noise).
"output" is the engine loop's part: the step's token deltas built and sent on a real channel (StepDeltas where
the tree has it, else a TokenDelta frame per request), the consumer draining it untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path


def measure(batch: int, rounds: int, steps: int, clock=time.perf_counter) -> dict[str, float]:
    """Milliseconds per step of each phase (the fastest round's), in the tree this process imports from."""
    from engine.core.request import SampledTokens

    try:
        from bench.offline.null_engine import Output, decoding_engine
    except ImportError:  # the tree measured is an older one: the helper beside this script
        from null_engine import Output, decoding_engine

    engine = decoding_engine(batch, 128, 1800, async_scheduling="on")
    output = Output()
    sched, runner = engine.scheduler, engine.executor.runner
    while engine.executor.num_in_flight:  # from here on this loop plays the executor
        sched.update(*engine.executor.collect())
    in_flight, best = deque(), None
    for _ in range(rounds):
        totals = {"schedule": 0.0, "prepare": 0.0, "update": 0.0, "output": 0.0}
        for _ in range(steps):
            t0 = clock()
            batch_ = sched.schedule()
            t1 = clock()
            runner.prepare(batch_)
            totals["schedule"] += t1 - t0
            totals["prepare"] += clock() - t1
            assert len(batch_) == batch
            in_flight.append(batch_)
            if len(in_flight) == 2:
                done = in_flight.popleft()
                ids = getattr(done, "sampling_ids", None) or [sr.request_id for sr in done.requests if sr.sample]
                sampled = {rid: SampledTokens([5]) for rid in ids}
                t2 = clock()
                updated = sched.update(done, sampled)
                t3 = clock()
                output.publish(updated)
                t4 = clock()
                totals["update"] += t3 - t2
                totals["output"] += t4 - t3
                output.drain()
        ms = {k: v / steps * 1e3 for k, v in totals.items()}
        ms["total"] = sum(ms.values())
        if best is None or ms["total"] < best["total"]:
            best = ms
    output.close()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare (each imports its own engine)")
    ap.add_argument("--batch", type=int, nargs="+", default=[64], help="decoding requests (one measurement each)")
    ap.add_argument("--runs", type=int, default=4, help="processes per tree and batch, interleaved")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="steps per round")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter; cpu: this thread's CPU time (steadier where other work shares the cores)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        print(json.dumps(measure(args.batch[0], args.rounds, args.steps, clock)))
        return 0
    results = {str(b): {tree: [] for tree in args.trees} for b in args.batch}
    for run in range(args.runs):
        for b in args.batch:
            for tree in args.trees:
                path = Path(tree).resolve()
                env = {**os.environ, "PYTHONPATH": str(path)}
                # This script, importing the tree's engine: a tree from before the script existed still compares.
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--child", "--batch", str(b)]
                    + ["--rounds", str(args.rounds), "--steps", str(args.steps), "--clock", args.clock],
                    cwd=path,
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                ms = json.loads(out.stdout.strip().splitlines()[-1])
                results[str(b)][tree].append(ms)
                print(f"run {run} batch {b} {tree}: " + " ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)
    summary = {
        b: {tree: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for tree, runs in trees.items()}
        for b, trees in results.items()
    }
    for b, trees in summary.items():
        for tree, ms in trees.items():
            print(f"batch {b} {tree}: median of runs, ms/step: " + " ".join(f"{k} {v:.3f}" for k, v in ms.items()))
    if args.out:
        from bench.common import write_report  # not at the top: the children import from trees that may lack it

        write_report(
            args.out,
            {
                "batch": args.batch,
                "clock": args.clock,
                "load_average": os.getloadavg(),
                "runs": results,
                "median_ms": summary,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
