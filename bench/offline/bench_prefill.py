"""Prefill time by prompt length, two or more checkouts side by side: each tree's `LLM()` (the defaults) in a process of
its own, the same prompts sent to each in turn, one at a time with max_tokens=1 (the step that prefills a prompt
also samples its first token). Medians per tree and length, and the median of the paired ratios to the first tree.

    git worktree add /tmp/old REV
    .venv/bin/python -m bench.offline.bench_prefill --trees /tmp/old . --tokens 130 480 1800 4000 --out F.json

A tree's C++ ops build into its own TORCH_EXTENSIONS_DIR (under /tmp), so two trees never load each other's builds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import write_report

# A worker: reads prompt token counts and seeds, answers the prefill's seconds (each line JSON). Run by `-c` in its
# tree, it imports that tree's engine: `-c` puts the working directory first on the module path.
WORKER = r"""
import json, random, sys, time
from engine import LLM, SamplingParams
llm = LLM()
engine, tokenizer = llm.engine, llm.tokenizer
words = ["On", "Monday,", "Ada", "from", "Lisbon", "bought", "a", "red", "bicycle.", "Then", "she", "rode", "it",
         "to", "the", "old", "market", "and", "sold", "three", "books", "for", "ten", "coins", "each."]
print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    tokens, seed = json.loads(line)
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(tokens)))[:tokens]
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    print(json.dumps(time.perf_counter() - start), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="checkouts to import from; ratios are to the first")
    ap.add_argument("--tokens", type=int, nargs="+", default=[130, 480, 1800])
    ap.add_argument("--prompts", type=int, default=8, help="timed prompts per length and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    workers = []
    for tree in trees:
        # Named by the tree's path (hash() of a str differs from run to run: every run would build again).
        name = hashlib.sha1(tree.encode()).hexdigest()[:12]
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=f"/tmp/bench_prefill_ext_{name}")
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tree,
            )
        )
    for w in workers:
        assert json.loads(w.stdout.readline()) == "ready"

    def prefill(w: subprocess.Popen, tokens: int, seed: int) -> float:
        w.stdin.write(json.dumps([tokens, seed]) + "\n")
        w.stdin.flush()
        return json.loads(w.stdout.readline())

    seconds: dict[int, list[list[float]]] = {n: [[] for _ in trees] for n in args.tokens}
    rng = random.Random(0)
    for n in args.tokens:  # warm-up: every length once in each tree
        for w in workers:
            prefill(w, n, -1)
    for r in range(args.rounds):
        for n in args.tokens:
            for _ in range(args.prompts if n < 1000 else max(2, args.prompts // 4)):
                seed = rng.randrange(1 << 30)
                order = list(range(len(trees)))
                rng.shuffle(order)  # who goes first alternates
                for i in order:
                    seconds[n][i].append(prefill(workers[i], n, seed))
        print(
            f"round {r}:",
            {n: [round(statistics.median(s) * 1e3, 1) for s in v] for n, v in seconds.items()},
            flush=True,
        )
    for w in workers:
        w.stdin.close()
        w.wait()
    result = {"trees": trees, "lengths": {}}
    for n, per_tree in seconds.items():
        result["lengths"][n] = {
            "median_ms": [statistics.median(s) * 1e3 for s in per_tree],
            "median_ratio_to_first": [statistics.median(a / b for a, b in zip(per_tree[0], s)) for s in per_tree],
            "prompts": len(per_tree[0]),
        }
        print(
            n,
            "tokens:",
            json.dumps(
                {k: [round(x, 3) for x in v] if isinstance(v, list) else v for k, v in result["lengths"][n].items()}
            ),
        )
    if args.out:
        write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
