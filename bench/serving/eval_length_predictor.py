"""The length predictor's accuracy (issue 31): train it online on N requests of the mixed workload
(bench/serving/length_workload.py), then judge its prediction from the prompt alone on held-out requests: Kendall's tau
against the real lengths, beside the taus of max_tokens and of the prompt's length.

    python -m bench.serving.eval_length_predictor --train 2000 --held-out 400 --predictor /tmp/length.safetensors \\
        --out benchmarks/results/length_aware/predictor.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import write_report
from bench.serving.length_workload import kendall_tau, requests
from engine import LLM, SamplingParams


def run(llm: LLM, batch: list[tuple[str, str, int]]) -> list[dict]:
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for _, p, _ in batch]
    reqs = [
        llm.engine.add_request(i, SamplingParams(max_tokens=m, temperature=0.0)) for i, (_, _, m) in zip(ids, batch)
    ]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return [
        {
            "kind": k,
            "prompt_tokens": len(i),
            "max_tokens": m,
            "output_tokens": r.num_output_tokens,
            "predicted": r.length.first_predicted if r.length is not None else None,
            "finish": r.finish_reason,
        }
        for (k, _, m), i, r in zip(batch, ids, reqs)
    ]


def taus(rows: list[dict]) -> dict:
    real = [r["output_tokens"] for r in rows]
    out = {
        "max_tokens": kendall_tau([r["max_tokens"] for r in rows], real),
        "prompt_tokens": kendall_tau([r["prompt_tokens"] for r in rows], real),
    }
    if all(r["predicted"] is not None for r in rows):
        out["predicted"] = kendall_tau([r["predicted"] for r in rows], real)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--held-out", type=int, default=400)
    ap.add_argument("--chunk", type=int, default=200, help="training requests per batch (it learns between them)")
    ap.add_argument("--predictor", default=None, help="the predictor's file: saved after training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.predictor:
        Path(args.predictor).unlink(missing_ok=True)
    llm = LLM(scheduling_policy="predicted", length_predictor=args.predictor)
    predictor = llm.engine.scheduler.policy.predictor
    rng = random.Random(args.seed)
    progress, t0 = [], time.time()
    for start in range(0, args.train, args.chunk):
        rows = run(llm, requests(rng, min(args.chunk, args.train - start)))
        # Judged before it learns from them: each chunk is held out from what came before.
        entry = {"trained_on": start, "requests": len(rows), **taus(rows)}
        progress.append(entry)
        print(json.dumps(entry), f"{time.time() - t0:.0f}s", flush=True)
    predictor.save()
    trained_on = predictor.num_requests
    predictor.REFIT_EVERY = predictor.SAVE_EVERY = 10**9  # frozen: the held-out requests change nothing
    held = run(llm, requests(random.Random(args.seed + 1), args.held_out))
    result = {
        "trained_on": trained_on,
        "held_out": len(held),
        "kendall_tau": taus(held),
        "by_kind": {
            k: {
                "output_tokens_median": statistics.median(r["output_tokens"] for r in held if r["kind"] == k),
                "predicted_median": statistics.median(r["predicted"] for r in held if r["kind"] == k),
            }
            for k in sorted({r["kind"] for r in held})
        },
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_report(
            args.out, {"seconds": round(time.time() - t0), **result, "progress": progress, "held_out_rows": held}
        )
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
