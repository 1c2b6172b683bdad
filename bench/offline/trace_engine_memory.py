"""What the engine core keeps per request: tracemalloc growth over many short requests, in this process.

Runs the engine in-process (no gateway, no shared-memory channel), 16 requests a batch, 2 tokens each;
compares snapshots after a warm-up and after --requests more, and prints bytes per request and the
allocation sites that grew most.

    python -m bench.offline.trace_engine_memory --requests 2000
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    engine = build_engine(EngineConfig(dtype="float32", max_num_seqs=16))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(n: int, base: int) -> None:
        for i in range(n):  # distinct prompts: the prefix cache keeps naming new blocks
            engine.add_request([100 + (base + i) % 5000, 7, 8, 9 + i % 50], params)
            if i % 16 == 15:
                while engine.has_unfinished():
                    engine.step()
        while engine.has_unfinished():
            engine.step()

    run(1000, 0)  # warm-up: caches, the first prefix-cache names, torch's allocator
    gc.collect()
    tracemalloc.start(25)
    run(500, 10_000)
    gc.collect()
    before = tracemalloc.take_snapshot()
    run(args.requests, 20_000)
    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(before, "traceback")
    total = sum(s.size_diff for s in stats)
    print(f"growth over {args.requests} requests: {total} bytes = {total / args.requests:.2f} bytes/request")
    for s in stats[: args.top]:
        print(f"{s.size_diff:+d} B in {s.count_diff:+d} blocks at", s.traceback.format()[-2].strip())


if __name__ == "__main__":
    main()
