"""How far can prompt-lookup speculation go on this machine? (issue 30)

Greedy outputs of N prompts (speculation off) are the truth each draft is checked against: for a greedy request a
draft token is accepted exactly where it equals the next output. Replaying each request step by step, a drafting
policy picks the draft length; the cost model of engine/core/speculation.py (a step of R rows costs 1 + r R, r the
row cost) turns steps and rows into a modeled speedup over one token per step. Policies: the engine's running
acceptance estimate, and an oracle that drafts exactly the tokens that will be accepted (the drafter's ceiling).
With --pass-rows P the cost has the CPU kernels' shape instead: a row costs --row-cost of a one-row step and each
pass over the weights after the first (a pass multiplies P rows: 4 with AVX2, 8 with AVX-512) --pass-cost more; the
engine's rule then sees those costs as measured (its StepCost primed with them). Each policy runs twice: drafting
from the request's own context alone, and (`shared`) from the earlier requests' outputs too where that has no match.

    python -m bench.offline.spec_ceiling --prompts 60 --out benchmarks/results/speculative/ceiling_replay.json
    python -m bench.offline.spec_ceiling --prompts 60 --pass-rows 4 --row-cost 0.115 --pass-cost 0.15 --max-k 8 16 24 \
        --out /tmp/ceiling_avx2.json
    python -m bench.offline.spec_ceiling --prompts 80 --pass-rows 12 --row-cost 0.118 --max-k 11 16 \
        --out /tmp/ceiling_shared.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable

from bench.common import write_report
from bench.serving.bench_speculative import chat, grounded
from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.core.speculation import Speculation
from engine.drafting.sources import NgramSource


def replay(
    data: list[tuple[list[int], list[int]]],
    min_n: int,
    max_k: int,
    step_cost: Callable[[int], float],
    oracle: bool,
    shared: bool,
) -> dict:
    """Modeled speedup, tokens per step and draft acceptance of one policy over every request, served one at a time
    in order (so `shared` drafts come from the outputs before); `step_cost(R)`: a step of R rows in units of a
    one-row step. The engine's rule is engine/core/speculation.py itself, given its drafts' outcomes."""
    cost = tokens = steps = drafted = accepted = 0
    policy = Speculation(NgramSource(shared=shared, min_n=min_n), max_k)
    for _ in range(10):  # the engine's measured costs, as if it had run these steps
        for rows in range(1, max_k + 2):
            policy.step_cost.observe(rows, step_cost(rows))
    for i, (prompt, out) in enumerate(data):
        req = Request(str(i), prompt, SamplingParams(max_tokens=len(out), temperature=0.0))
        drafters, t = (policy.source.new_drafters() if oracle else []), 0  # the oracle's: the rule has its own
        while t < len(out):
            req.output_token_ids = out[:t]
            limit = len(out) - t - 1  # what max_tokens leaves for drafts
            if oracle:
                context = prompt + out[:t]
                draft = next((d for d in (drafter.propose(context, limit) for drafter in drafters) if d), [])
            else:
                draft = policy.draft(req, limit, policy.new_step(1))
            agree = 0
            while agree < len(draft) and draft[agree] == out[t + agree]:
                agree += 1
            k = min(agree, max_k) if oracle else len(draft)
            if not oracle and k:
                policy.verified(req, k, agree)
            drafted, accepted = drafted + k, accepted + min(agree, k)
            advance = min(agree, k) + 1
            t, tokens, steps, cost = t + advance, tokens + advance, steps + 1, cost + step_cost(1 + k)
        policy.source.finished(out)
    return {
        "modeled_speedup": tokens / cost,
        "tokens_per_step": tokens / steps,
        "acceptance": accepted / max(1, drafted),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--row-cost", type=float, default=0.25, help="a row's share of a step (see --pass-rows)")
    ap.add_argument("--pass-rows", type=int, default=None, help="rows a pass over the weights multiplies")
    ap.add_argument("--pass-cost", type=float, default=0.0, help="each pass after the first, as a share of a step")
    ap.add_argument("--max-k", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    r, p, c = args.row_cost, args.pass_rows, args.pass_cost

    def step_cost(rows: int) -> float:
        if p is None:
            return (1 + r * rows) / (1 + r)
        return 1 + r * (rows - 1) + c * (math.ceil(rows / p) - 1)

    llm = LLM(speculative="off")
    tok = llm.tokenizer
    result = {"row_cost": r, "pass_rows": p, "pass_cost": c, "workloads": {}}
    for name, make in [("grounded", grounded), ("chat", chat)]:
        rng = random.Random(args.seed)
        ids = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": make(rng)}])) for _ in range(args.prompts)
        ]
        outs = llm.generate(ids, SamplingParams(max_tokens=256, temperature=0.0))
        data = [(i, list(o.token_ids)) for i, o in zip(ids, outs)]
        rows = {}
        for shared in (False, True):
            for min_n in (2, 1):
                for max_k in args.max_k:
                    for oracle in (False, True):
                        key = f"{'oracle' if oracle else 'engine'} n>={min_n} k<={max_k}{' shared' if shared else ''}"
                        rows[key] = replay(data, min_n, max_k, step_cost, oracle, shared)
                        print(name, key, json.dumps({k: round(v, 3) for k, v in rows[key].items()}), flush=True)
        result["workloads"][name] = rows
    if args.out:
        write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
