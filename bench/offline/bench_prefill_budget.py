"""What the per-iteration token budget costs on this machine: prefill throughput against the longest step.

A long prompt is prefilled in chunks of at most `max_num_batched_tokens` tokens, one chunk per iteration,
next to 32 running decodes. A larger budget prefills a little faster, but every stream waits for the whole
chunk: the step time is the inter-token latency the decodes see. Interleaved repeats, medians.

    python -m bench.offline.bench_prefill_budget --out benchmarks/results/offline/prefill_budget.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import write_report
from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint


def run(llm: LLM, prompt_len: int, decodes: int) -> dict:
    """Prefill one `prompt_len` prompt beside `decodes` running requests; its time and the longest step."""
    engine = llm.engine
    keep = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    running = [engine.add_request([100 + i] * 16, keep) for i in range(decodes)]
    while any(r.num_computed_tokens < 16 for r in running):  # get them decoding first
        engine.step()
    prompt = engine.add_request([(7 * j) % 40000 + 50 for j in range(prompt_len)], SamplingParams(max_tokens=1))
    steps = []
    t0 = time.perf_counter()
    while prompt.num_computed_tokens < prompt_len:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    for r in running:
        engine.abort_request(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return {"prefill_s": total, "max_step_s": max(steps), "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/offline/prefill_budget.json")
    args = ap.parse_args()
    ckpt = load_checkpoint(None)
    llms = {b: LLM(checkpoint=ckpt, max_num_batched_tokens=b, max_num_seqs=args.decodes + 1) for b in args.budgets}
    for llm in llms.values():  # warm-up
        run(llm, 256, 4)
    samples: dict[int, list[dict]] = {b: [] for b in args.budgets}
    for _ in range(args.repeats):
        for b, llm in llms.items():  # interleaved
            samples[b].append(run(llm, args.prompt_len, args.decodes))
    table = {}
    for b, runs in samples.items():
        prefill = statistics.median(r["prefill_s"] for r in runs)
        table[b] = {
            "prefill_tok_s": args.prompt_len / prefill,
            "max_step_s": statistics.median(r["max_step_s"] for r in runs),
        }
        print(
            f"budget {b:>5}: prefill {table[b]['prefill_tok_s']:7.1f} tok/s beside {args.decodes} decodes, "
            f"longest step {table[b]['max_step_s']:.3f} s",
            flush=True,
        )
    report = {"prompt_len": args.prompt_len, "decodes": args.decodes, "medians": table, "samples": samples}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
