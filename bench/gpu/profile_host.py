"""Where a step's host time goes: decode steps and mixed steps (a prompt joining a decoding batch), each with
whole-step graphs and with piecewise ones, timed, then under cProfile.

    python -m bench.gpu.profile_host --shape llama-1b --batch 64 --out profile_host.json

A GPU step is host-bound when its wall time exceeds the device's (profile_iteration.py gives the device's); this
says which Python functions the host time is spent in. cProfile slows Python down, so its table is for shares,
and the timed medians come from runs without it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

from bench.common import write_report
from bench.gpu.bench_gpu import graph_runners, make_engine, set_graphs
from engine import SamplingParams


def decode_batch(engine, batch: int, context: int, steps: int) -> None:
    """`batch` requests decoding after `context` prompt tokens, with tokens to spare for `steps` steps."""
    for i in range(batch):
        ids = [(7 * i + j) % engine.shape.vocab_size for j in range(context)]
        engine.add_request(ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()


def mixed_step(engine, prompt_len: int, k: int) -> float:
    """A step in which a `prompt_len`-token prompt joins the decoding batch, with the step after it (the newcomer
    aborted between them): with asynchronous scheduling a step launches its batch and waits for the one before, so
    the mixed batch's device time ends inside the second step."""
    ids = [(11 * k + j) % engine.shape.vocab_size for j in range(prompt_len)]
    req = engine.add_request(ids, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    engine.abort_request(req.request_id)
    engine.step()
    return time.perf_counter() - t


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def profiled(fn, n: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=400, help="the prompt joining a mixed step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode (and as many profiled)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/gpu/profile_host.json")
    args = ap.parse_args()
    args.batches, args.requests, args.token_budget, args.kv_gib = [args.batch + 1], 0, None, 8.0
    engine = make_engine(args.shape, args)
    graphs = graph_runners(engine)
    decode_batch(engine, args.batch, args.context, 12 * args.steps + 20)  # outlasts every timed step
    report = {"shape": args.shape, "batch": args.batch, "runner": engine.runner.describe(), "modes": {}}
    k = iter(range(10**6))
    cases = {
        "decode whole": ("whole", lambda: engine.step()),
        "decode piecewise": ("piecewise", lambda: engine.step()),
        "mixed": ("whole", lambda: mixed_step(engine, args.prompt_len, next(k))),
        "mixed piecewise": ("piecewise", lambda: mixed_step(engine, args.prompt_len, next(k))),
    }
    decode_ms = {}
    for name, (mode, fn) in cases.items():  # decodes first: a mixed case is reported as its pair less a decode
        set_graphs(engine, mode, graphs)
        timed(fn, 3)  # warm-up
        if name.startswith("mixed"):
            seconds = [mixed_step(engine, args.prompt_len, next(k)) for _ in range(args.steps)]
        else:
            seconds = timed(fn, args.steps)
        table = profiled(fn, args.steps, args.top)
        median_ms = statistics.median(seconds) * 1e3
        row = report["modes"][name] = {
            "median_ms": median_ms,
            "min_ms": min(seconds) * 1e3,
            "profile": table,
            "steps_by_path": dict(engine.runner.step_paths),
        }
        if name.startswith("decode"):
            decode_ms[mode] = median_ms
        else:  # the mixed step and the decode after it, less a decode step of the same mode
            row.update(pair_median_ms=median_ms, median_ms=median_ms - decode_ms[mode])
        print(f"== {name}: median {row['median_ms']:.2f} ms, min {min(seconds) * 1e3:.2f} ms", flush=True)
        print(table, flush=True)
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
