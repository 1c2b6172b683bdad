"""--check-in-steps K: host time per generated token with a null model, and offline decode throughput with a real one.

    python -m bench.offline.bench_check_ins --steps 1 4 8 --runs 5 \\
        --out benchmarks/results/offline/check_ins.json

"null": dummy:tiny's engine with its model swapped for one that returns fixed logits over a small vocabulary, so a
generated token's time is the host's alone: schedule, prepare, sample, update, and the engine loop's output (the
step's deltas built and sent on a real channel, the consumer draining it untimed). "model": the bundled model (or
--model), greedy, every request decoding to max_tokens. Settings are interleaved run by run; medians are reported,
of wall time and of this process's CPU time (the fairer figure on a shared machine, with --threads 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def host_per_token(steps: int, batch: int, tokens: int) -> dict[str, float]:
    """Microseconds of host time per generated token, decoding `batch` requests for `tokens` tokens each."""
    from bench.offline.null_engine import Output, decoding_engine

    engine = decoding_engine(batch, 32, tokens + 1, null_model=True, check_in_steps=steps)
    output = Output()
    generated, iterations = 0, 0
    t, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        generated += output.publish(engine.step())
        iterations += 1
        output.drain()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    output.close()
    return {
        "us_per_token": seconds / generated * 1e6,
        "cpu_us_per_token": cpu / generated * 1e6,
        "tokens": generated,
        "check_ins": iterations,
    }


def model_throughput(steps: int, ckpt, prompts: list[list[int]], tokens: int, speculative: str) -> dict[str, float]:
    """Generated tokens per second, every request decoding `tokens` tokens greedily (prefill included)."""
    from engine import SamplingParams
    from engine.core.config import EngineConfig
    from engine.launch import build_engine

    engine = build_engine(
        EngineConfig(device="cpu", speculative=speculative, check_in_steps=steps, max_num_seqs=len(prompts)), ckpt
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    t, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    generated = sum(r.num_output_tokens for r in reqs)
    return {
        "tokens_per_s": generated / seconds,
        "tokens_per_cpu_s": generated / cpu,
        "check_ins": engine.num_iterations,
        "outputs": [r.output_token_ids for r in reqs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8], help="values of --check-in-steps")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--null-batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--null-tokens", type=int, default=256, help="tokens per request, null model")
    ap.add_argument("--model", default=None, help="the real model (unset: the bundled one)")
    ap.add_argument("--model-batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--model-tokens", type=int, default=64, help="tokens per request, real model")
    ap.add_argument("--speculative", default="off", help="the real model's --speculative")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.offline.bench_offline import prompts_for
    from engine.model.loader import load_checkpoint

    ckpt = load_checkpoint(args.model)
    null = {f"{b}/{k}": [] for b in args.null_batch for k in args.steps}
    model = {f"{b}/{k}": [] for b in args.model_batch for k in args.steps}
    for run in range(args.runs):
        for b in args.null_batch:
            for k in args.steps:
                null[f"{b}/{k}"].append(host_per_token(k, b, args.null_tokens))
                print(f"run {run} null batch {b} K {k}: {null[f'{b}/{k}'][-1]}", flush=True)
        for b in args.model_batch:
            want = None
            for k in args.steps:
                r = model_throughput(k, ckpt, prompts_for(ckpt.tokenizer, b), args.model_tokens, args.speculative)
                outputs = r.pop("outputs")
                want = want or outputs
                r["same_tokens_as_first"] = outputs == want
                model[f"{b}/{k}"].append(r)
                print(f"run {run} model batch {b} K {k}: {r}", flush=True)
    summary = {
        f"{kind}_{measure}": {key: statistics.median(r[measure] for r in rs) for key, rs in runs.items()}
        for kind, runs, measures in (
            ("null", null, ("us_per_token", "cpu_us_per_token")),
            ("model", model, ("tokens_per_s", "tokens_per_cpu_s")),
        )
        for measure in measures
    }
    print(summary)
    if args.out:
        from bench.common import write_report

        write_report(
            args.out,
            {
                "keys": "batch/K",
                "null_tokens": args.null_tokens,
                "model": ckpt.name,
                "model_tokens": args.model_tokens,
                "speculative": args.speculative,
                "median": summary,
                "null_runs": null,
                "model_runs": model,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
