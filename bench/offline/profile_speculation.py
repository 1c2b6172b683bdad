"""Where a speculating engine's time goes, offline: each `EngineCore.step` timed whole and in its parts (schedule,
run, update), for waves of `--concurrency` requests of bench_speculative.py's workloads, with speculation on and
off in turn (one process each, the same prompts). Reports tokens a second, the prompts' steps, the decode steps by
their rows (a request's token and its drafts), and the host's share.

    python -m bench.offline.profile_speculation --workload grounded --concurrency 1 --waves 20
    python -m bench.offline.profile_speculation --workload chat --concurrency 32 --waves 2 --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time


def ms(xs: list[float]) -> float | None:
    """The mean of `xs` seconds in milliseconds (None for none)."""
    return round(1e3 * statistics.mean(xs), 3) if xs else None


def profile(args: argparse.Namespace, speculative: str) -> dict:
    from bench.serving.bench_speculative import WORKLOADS
    from engine import LLM, SamplingParams
    from engine.model.loader import load_checkpoint

    llm = LLM(
        checkpoint=load_checkpoint(None),
        speculative=speculative,
        num_threads=args.threads,
        max_num_seqs=max(64, args.concurrency),
    )
    engine, tokenizer = llm.engine, llm.tokenizer
    make, temperature = WORKLOADS[args.workload]
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature)
    step: dict = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            started = time.perf_counter()
            out = fn(*a, **k)
            step[name] = time.perf_counter() - started
            if name == "schedule":
                step["rows"] = out.num_tokens  # a prompt chunk: more tokens than a decode and its drafts
                step["prompt"] = any(len(r.token_ids) > r.num_draft + 1 for r in out.requests)
            return out

        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.executor.submit = timed("run", engine.executor.submit)
    engine.scheduler.update = timed("update", engine.scheduler.update)
    steps, tokens, seconds = [], 0, 0.0
    for wave in range(args.waves + 1):  # the first wave warms up
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": make(rng)}]) for _ in range(args.concurrency)
        ]
        requests = [engine.add_request(p if isinstance(p, list) else tokenizer.encode(p), params) for p in prompts]
        started = time.perf_counter()
        while engine.has_unfinished():
            step.clear()
            t = time.perf_counter()
            engine.step()
            step["total"] = time.perf_counter() - t
            if wave:
                steps.append(dict(step))
        if wave:
            seconds += time.perf_counter() - started
            tokens += sum(len(r.output_token_ids) for r in requests)
    llm.close()
    prompt_steps = [s for s in steps if s.get("prompt")]
    decode = [s for s in steps if "rows" in s and not s.get("prompt")]
    by_rows: dict[int, list[float]] = {}
    for s in decode:
        by_rows.setdefault(s["rows"], []).append(s["run"])
    return {
        "speculative": speculative,
        "output_tok_s": round(tokens / seconds, 1),
        "tokens": tokens,
        "prompt_steps": len(prompt_steps),
        "prompt_step_ms": ms([s["total"] for s in prompt_steps]),
        "prompt_share": round(sum(s["total"] for s in prompt_steps) / seconds, 4),
        "decode_steps": len(decode),
        "decode_step_ms": ms([s["total"] for s in decode]),
        "schedule_ms": ms([s["schedule"] for s in decode]),
        "update_ms": ms([s["update"] for s in decode]),
        "run_ms_by_rows": {
            rows: {"steps": len(v), "median_ms": round(1e3 * statistics.median(v), 3)}
            for rows, v in sorted(by_rows.items())
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["grounded", "chat"], default="grounded")
    ap.add_argument("--concurrency", type=int, default=1, help="requests a wave, added together")
    ap.add_argument("--waves", type=int, default=20, help="timed waves, after one to warm up")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=["auto", "off"], help="--speculative values, in this order")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one variant, JSON out
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(profile(args, args.one)))
        return 0
    results = []
    for variant in args.variants:  # a process each: both start from a cold engine and the same prompts
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--one", variant], capture_output=True, text=True, check=True
        )
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"--speculative {variant}: {r['output_tok_s']} tok/s; prompt steps {r['prompt_step_ms']} ms "
            f"({r['prompt_share']:.1%} of the time); decode steps {r['decode_step_ms']} ms, schedule "
            f"{r['schedule_ms']} ms, update {r['update_ms']} ms",
            flush=True,
        )
        for rows, v in r["run_ms_by_rows"].items():
            print(f"    {rows:>4} rows: {v['steps']:5d} steps, run {v['median_ms']} ms (median)")
    if args.out:
        from bench.common import write_report

        write_report(args.out, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
