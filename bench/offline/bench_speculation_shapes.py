"""Speculation on or off, per model shape, offline: a model's decode CPU time per output token with `--speculative
off` and `ngram` (or any other configs), at 1 and 8 concurrent requests of bench_speculative.py's workloads
(grounded: greedy; chat: temperature 0.7), or of prompts that repeat a random sequence (drafts a model mostly
rejects). Drafts come from each request's own context only: the rounds repeat their prompts, and a shared pool would
draft a request's earlier answer to it. One thread, and the thread's CPU time, not the wall clock: on a shared,
oversubscribed machine that counts the work, not the waits for a core. Prompt steps are left out (every variant
prefills the same prompts); rounds alternate the variants' order, and each variant's engine keeps its own prefix
cache, so a round after the first prefills next to nothing.

    python -m bench.offline.bench_speculation_shapes --model /tmp/gemma3-270m-q4_k_m.gguf \\
        --out benchmarks/results/defaults/speculation_gemma3-270m.json
    python -m bench.offline.bench_speculation_shapes --model F --variant f32='{"speculative": "off"}' \\
        --variant bf16='{"speculative": "off", "dtype": "bfloat16"}'     # any two or more configs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# Every variant: one thread, drafts from a request's own context (see above); a variant adds its own fields.
BASE = {"num_threads": 1, "speculative_shared": False}
DEFAULT_VARIANTS = {"off": {"speculative": "off"}, "ngram": {"speculative": "ngram"}}


def decode_run(engine, prompts: list[list[int]], params) -> dict:
    """Runs `prompts` together to the end; the CPU seconds of the steps without prompt tokens, and their counts."""
    sched = engine.scheduler.schedule
    seen: dict = {}

    def schedule(*a, **k):
        batch = sched(*a, **k)
        seen["prompt"] = any(len(r.token_ids) > r.num_draft + 1 for r in batch.requests)
        seen["drafts"] = sum(r.num_draft for r in batch.requests)
        seen["rows"] = sum(1 for r in batch.requests if r.sample)
        return batch

    engine.scheduler.schedule = schedule
    requests = [engine.add_request(p, params) for p in prompts]
    cpu = steps = drafts = rows = 0
    while engine.has_unfinished():
        seen.clear()
        t = time.thread_time()
        engine.step()
        spent = time.thread_time() - t
        if seen and not seen["prompt"]:
            cpu, steps, drafts, rows = cpu + spent, steps + 1, drafts + seen["drafts"], rows + seen["rows"]
    engine.scheduler.schedule = sched
    tokens = sum(len(r.output_token_ids) for r in requests) - len(requests)  # each prompt step's token left out
    return {"cpu_s": cpu, "tokens": tokens, "steps": steps, "drafts": drafts, "accepted": tokens - rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    ap.add_argument(
        "--variant", action="append", default=[], metavar="NAME=JSON", help="EngineConfig fields (default: off, ngram)"
    )
    ap.add_argument(
        "--workload",
        choices=["grounded", "chat", "repeat"],
        default="grounded",
        help="chat: sampled, T 0.7; repeat: 16 random ids 8 times over, greedy (prompt lookup drafts the loop on)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=63)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from bench.serving.bench_speculative import WORKLOADS
    from engine import LLM, SamplingParams
    from engine.model.loader import load_checkpoint

    torch.set_num_threads(1)
    ckpt = load_checkpoint(args.model)
    configs = {n: json.loads(c) for n, c in (v.split("=", 1) for v in args.variant)} or DEFAULT_VARIANTS
    variants = list(configs)
    llms = {v: LLM(checkpoint=ckpt, **{**BASE, **configs[v]}) for v in variants}
    tok = llms[variants[0]].tokenizer
    rng = random.Random(args.seed)
    make, temperature = WORKLOADS.get(args.workload, (None, 0.0))

    def prompt() -> list[int]:
        if make is None:  # drafts a model trained on nothing like it mostly rejects: what a rejected row costs
            return [rng.randrange(1000, 20000) for _ in range(16)] * 8
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": make(rng)}]))

    prompts = {c: [prompt() for _ in range(c)] for c in args.concurrency}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature)
    runs: dict = {str(c): {v: [] for v in variants} for c in args.concurrency}
    started = os.getloadavg()
    for r in range(args.rounds):
        for c in args.concurrency:
            for v in variants if r % 2 == 0 else variants[::-1]:
                res = decode_run(llms[v].engine, prompts[c], params)
                res["cpu_ms_per_token"] = 1e3 * res["cpu_s"] / max(1, res["tokens"])
                runs[str(c)][v].append(res)
                print(
                    f"round {r} c={c} {v}: {res['cpu_ms_per_token']:.2f} CPU ms/token "
                    f"({res['tokens']} tokens, {res['steps']} steps, {res['accepted']}/{res['drafts']} drafts)",
                    flush=True,
                )
    summary = {
        c: {v: statistics.median(x["cpu_ms_per_token"] for x in by_v[v]) for v in variants} for c, by_v in runs.items()
    }
    first, second = variants[0], variants[-1]
    for c, s in summary.items():
        print(
            f"c={c}: " + ", ".join(f"{v} {s[v]:.2f}" for v in variants) + f" CPU ms/token; {second}/{first} "
            f"{s[second] / s[first]:.3f}"
        )
    if args.out:
        from bench.common import write_report

        shape = ckpt.shape
        write_report(
            args.out,
            {
                "model": args.model or "bundled",
                "workload": args.workload,
                "shape": {"vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size, "params": shape.num_params},
                "variants": configs,
                "load_average_start_end": [started, os.getloadavg()],
                "summary_median_cpu_ms_per_token": summary,
                "runs": runs,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
