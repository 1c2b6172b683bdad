"""A decode step of the bundled model at each KV cache dtype (--kv-cache-dtype), float32 compute, speculation off: one
engine per dtype in one process, each with `--batch` requests of `--context` distinct prompt tokens prefilled, then
their decode steps timed in turn (the dtypes' order rotating each step), so every dtype runs under the same load;
the report has each dtype's median step and the median of its per-turn ratio to float32's step.

    .venv/bin/python -m bench.offline.bench_kv_cache_dtype --batch 32 --context 512 --steps 30 \\
        --out benchmarks/results/offline/kv_cache_dtype.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_report

DTYPES = ["float32", "bfloat16", "float16"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per dtype")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=int, default=2**30, help="bytes, the same for every dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine import LLM, SamplingParams
    from engine.model.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(None)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    engines = {}
    for kv in DTYPES:
        llm = LLM(
            checkpoint=checkpoint,
            num_threads=args.threads,
            max_num_seqs=args.batch,
            speculative="off",
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=kv,
        )
        engine = llm.engine
        requests = [  # distinct ids, so no request's prefix is cached from another's
            engine.add_request([1000 + (i * 7919 + j * 31) % 40000 for j in range(args.context)], params)
            for i in range(args.batch)
        ]
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):
            engine.step()
        engine.step()  # a warm decode step
        engines[kv] = (engine, llm.engine.scheduler.kv.num_blocks)
        print(f"{kv}: prefilled, {engines[kv][1]} blocks", flush=True)
    times = {kv: [] for kv in DTYPES}
    for i in range(args.steps):
        for kv in DTYPES[i % 3 :] + DTYPES[: i % 3]:
            start = time.perf_counter()
            engines[kv][0].step()
            times[kv].append(time.perf_counter() - start)
    medians = {kv: statistics.median(t) * 1e3 for kv, t in times.items()}
    ratios = {kv: statistics.median(a / b for a, b in zip(times[kv], times["float32"])) for kv in DTYPES[1:]}
    print("median step ms", medians, "ratio to float32", ratios, flush=True)
    if args.out:
        report = {"batch": args.batch, "context": args.context, "steps": args.steps, "median_step_ms": medians}
        blocks = {kv: n for kv, (_, n) in engines.items()}
        write_report(args.out, {**report, "step_over_float32": ratios, "kv_blocks": blocks})


if __name__ == "__main__":
    main()
