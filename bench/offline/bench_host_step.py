"""The host side of a decode step alone: schedule -> prepare -> update -> output, no model, two batches in flight.

    python -m bench.offline.bench_host_step --trees . /tmp/wt_base --batch 64 --runs 4 \\
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


def measure(batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase (the fastest round's), in the tree this process imports from."""
    from engine import SamplingParams
    from engine.core.config import EngineConfig, FaultPlan
    from engine.core.request import SampledTokens
    from engine.ipc.channel import Channel
    from engine.ipc.engine_loop import EngineLoop
    from engine.ipc.messages import FromEngine
    from engine.launch import build_engine

    try:
        from engine.ipc.messages import StepDeltas
    except ImportError:  # a tree from before it: a frame per request
        StepDeltas = None

    class Publisher:  # what EngineLoop.delta reads of its loop
        faults = FaultPlan()

    publisher = Publisher()
    outbox = Channel.create(FromEngine)
    consumer = Channel.attach(outbox.handle(), FromEngine)

    config = EngineConfig(
        model="dummy:tiny",
        device="cpu",
        max_num_seqs=batch,
        speculative="off",
        kv_cache_memory=2**30,
        async_scheduling="on",
    )
    engine = build_engine(config)
    for i in range(batch):
        engine.add_request(
            [(7 * i + j) % 40000 for j in range(128)], SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)
        )
    sched, runner = engine.scheduler, engine.executor.runner
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    while engine.executor.num_in_flight:  # from here on this loop plays the executor
        sched.update(*engine.executor.collect())
    in_flight, best = deque(), None
    for _ in range(rounds):
        totals = {"schedule": 0.0, "prepare": 0.0, "update": 0.0, "output": 0.0}
        for _ in range(steps):
            t0 = time.perf_counter()
            batch_ = sched.schedule()
            t1 = time.perf_counter()
            runner.prepare(batch_)
            totals["schedule"] += t1 - t0
            totals["prepare"] += time.perf_counter() - t1
            assert len(batch_) == batch
            in_flight.append(batch_)
            if len(in_flight) == 2:
                done = in_flight.popleft()
                ids = getattr(done, "sampling_ids", None) or [sr.request_id for sr in done.requests if sr.sample]
                sampled = {rid: SampledTokens([5]) for rid in ids}
                t2 = time.perf_counter()
                updated = sched.update(done, sampled)
                t3 = time.perf_counter()
                deltas = [EngineLoop.delta(publisher, r) for r in updated]
                if StepDeltas is not None:
                    outbox.send(StepDeltas(deltas))
                else:
                    for delta in deltas:
                        outbox.send(delta)
                t4 = time.perf_counter()
                totals["update"] += t3 - t2
                totals["output"] += t4 - t3
                consumer.recv_all()
        ms = {k: v / steps * 1e3 for k, v in totals.items()}
        ms["total"] = sum(ms.values())
        if best is None or ms["total"] < best["total"]:
            best = ms
    consumer.close()
    outbox.close()
    outbox.unlink()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare (each imports its own engine)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4, help="processes per tree, interleaved")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="steps per round")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.batch, args.rounds, args.steps)))
        return 0
    results = {tree: [] for tree in args.trees}
    for run in range(args.runs):
        for tree in args.trees:
            path = Path(tree).resolve()
            env = {**os.environ, "PYTHONPATH": str(path)}
            # This script, importing the tree's engine: a tree from before the script existed still compares.
            out = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    "--batch",
                    str(args.batch),
                    "--rounds",
                    str(args.rounds),
                    "--steps",
                    str(args.steps),
                ],
                cwd=path,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {run} {tree}: " + " ".join(f"{k} {v:.3f}" for k, v in results[tree][-1].items()), flush=True)
    summary = {tree: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for tree, runs in results.items()}
    for tree, ms in summary.items():
        print(f"{tree}: median of runs, ms/step: " + " ".join(f"{k} {v:.3f}" for k, v in ms.items()))
    if args.out:
        from bench.common import write_report  # not at the top: the children import from trees that may lack it

        write_report(args.out, {"batch": args.batch, "runs": results, "median_ms": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
