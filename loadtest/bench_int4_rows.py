"""Where the 4-bit weights stop paying: decode step time with int4 copies vs dense bfloat16 weights by batch size.

A step reads every weight once; at small batches reading bounds it and 4-bit weights win, at large ones
arithmetic does and unpacking them costs. The crossover sets `int4_max_rows`. Interleaved repeats, medians.

    python loadtest/bench_int4_rows.py --out benchmarks/int4_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import SamplingParams  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.launch import build_engine  # noqa: E402
from engine.model.loader import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 24, 32])
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request before decoding")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/int4_rows.json")
    args = ap.parse_args()
    ckpt = load_checkpoint(None)
    engines = {}
    for b in args.batches:
        for weights in ("int4", "dense"):
            # int4_max_rows past every batch: the int4 engine reads the 4-bit copies at every size.
            config = EngineConfig(max_num_seqs=b, weights=weights, int4_max_rows=1 << 20)
            engine = build_engine(config, ckpt)
            params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
            for i in range(b):
                engine.add_request([1000 + (i * 7 + j) % 20000 for j in range(args.context)], params)
            while any(r.num_computed_tokens < args.context for r in engine.scheduler.requests.values()):
                engine.step()
            engine.step()  # warm-up
            engines[(b, weights)] = engine
    samples: dict = {k: [] for k in engines}
    for _ in range(args.repeats):
        for key, engine in engines.items():  # interleaved
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            samples[key].append(statistics.median(times) * 1000)
    table = {}
    for b in args.batches:
        int4, dense = (statistics.median(samples[(b, w)]) for w in ("int4", "dense"))
        table[b] = {"int4_ms": int4, "dense_ms": dense, "int4_speedup": dense / int4}
        print(f"batch {b:>3}: int4 {int4:6.1f} ms  dense {dense:6.1f} ms  int4 speed-up {dense / int4:.2f}x", flush=True)
    report = {"command": "python " + " ".join(sys.argv), "what": "median decode step (ms) at each batch size",
              "medians": table, "samples_ms": {f"{b} {w}": v for (b, w), v in samples.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
