"""Where bench_gpu.py's offline throughput run (c)/(d) spends its time, per engine and per path.

Builds the iteration-level engine, runs the 256-request Orca workload once (round 0), then builds a
request-level engine beside it and runs both again (round 1), timing each phase of every step with
a device sync around it (schedule, prepare, run, sample, update) and which path ran the model
(whole-decode graphs, piecewise graphs, eager). The syncs make it a diagnosis, not a benchmark.

    python -m bench.gpu.profile_offline --shape llama-1b     # on a GPU machine
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from bench.gpu.bench_gpu import make_engine, sync, workload
from engine import SamplingParams
from engine.core.config import DUMMY_SHAPES


def timed(stats: dict, name: str, fn, device: torch.device, count_none: bool = True):
    def wrapped(*a, **k):
        sync(device)
        t = time.perf_counter()
        out = fn(*a, **k)
        sync(device)
        stats[name + "_s"] += time.perf_counter() - t
        stats[name + "_n"] += 1 if count_none or out is not None else 0
        return out

    return wrapped


def instrument(engine) -> dict:
    """Wrap each phase and path of this engine's steps in a timer; returns the totals it fills."""
    stats, r = collections.defaultdict(float), engine.runner
    for name, obj, attr, count_none in (
        ("decode_graphs", r.decode_graphs, "forward", False),
        ("piecewise", r.graphs, "forward", False),
        ("eager_model", r, "model", True),
        ("schedule", engine.scheduler, "schedule", True),
        ("update", engine.scheduler, "update", True),
        ("sample", engine.executor, "sampler", True),
        ("prepare", r, "prepare", True),
        ("run", r, "run", True),
    ):
        if obj is not None:
            setattr(obj, attr, timed(stats, name, getattr(obj, attr), r.device, count_none))
    return stats


def run(engine, work) -> tuple[float, int, int]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in work]
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - t, steps, sum(len(r.output_token_ids) for r in reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-1b", choices=sorted(DUMMY_SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--prefix-caching", action="store_true", help="round 1 then hits round 0's prompts")
    args = ap.parse_args()
    args.batches = [64]  # make_engine sizes max_num_seqs from these and --requests
    extra = {"prefix_caching": args.prefix_caching}
    engines = {"iteration": make_engine(args.shape, args, **extra)}
    work = workload(args.requests, (32, 512), (1, 128), engines["iteration"].shape.vocab_size, seed=0)
    for rnd in range(2):
        if rnd == 1:
            engines["request"] = make_engine(args.shape, args, scheduling="request", **extra)
        for name, engine in engines.items():
            stats = instrument(engine) if rnd == 1 else {}
            secs, steps, tokens = run(engine, work)
            print(f"round {rnd} {name}: {secs:.2f} s, {steps} steps, {tokens / secs:.0f} tok/s", flush=True)
            print("   ", {k: round(v, 3) for k, v in sorted(stats.items())}, flush=True)


if __name__ == "__main__":
    main()
