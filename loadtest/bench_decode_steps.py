"""Median time of a pure decode step at each batch size, for one engine config, in this checkout or another.

`--tree DIR` imports the engine from another checkout (an older commit, for a before/after), so both run the same
measurement: requests of ~10-token prompts decode together, a few warm-up steps, then the median of N timed steps.
Run the two trees alternately and compare medians; on a shared machine use one thread (two threads wait on each
other whenever another process holds a core).

    .venv/bin/python loadtest/bench_decode_steps.py --threads 1 --batches 1 8 32 --out /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="checkout to import from")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", default="{}", help="EngineConfig fields as JSON, e.g. '{\"dtype\": \"bfloat16\"}'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from engine import LLM, SamplingParams
    from engine.model.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    llm = LLM(checkpoint=load_checkpoint(None), num_threads=args.threads, max_num_seqs=max(args.batches),
              **json.loads(args.config))
    engine = llm.engine
    result = {}
    for batch in args.batches:
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(llm.tokenizer.encode(f"The history of the printing press begins {i}"), params)
        for _ in range(3):  # the prefill, then warm decode steps
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
        result[batch] = statistics.median(times) * 1e3
        print(f"batch {batch:>3}: {result[batch]:.2f} ms a step", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "tree": args.tree,
                                              "dtype": engine.config.dtype, "median_step_ms": result}, indent=2))


if __name__ == "__main__":
    main()
