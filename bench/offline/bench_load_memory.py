"""Peak memory of loading a model: a fresh process per checkout loads the checkpoint and builds the CPU model as the
engine does (the served defaults), and reports its peak RSS and what it holds after. Checkouts alternate per round.

    python -m bench.offline.bench_load_memory --trees . /tmp/old-checkout --rounds 2 \\
        --out benchmarks/results/memory/load_bundled.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_report

# Run inside the checkout (its engine package first on the path); prints one JSON line.
PROBE = """
import json, resource, sys, time
import psutil
from engine.core.config import EngineConfig
from engine.model.loader import load_checkpoint
from engine.runner.local_executor import build_model
model = sys.argv[1] or None
start = time.perf_counter()
ckpt = load_checkpoint(model)
built = build_model(ckpt, 2048, EngineConfig(model=model).with_(device="cpu", dtype="float32"))
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "after_mib": psutil.Process().memory_info().rss / 2**20, "seconds": time.perf_counter() - start}))
"""


def probe(tree: Path, model: str, extensions: str) -> dict:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions}  # each checkout's C++ ops built once, not in turn
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to load from")
    ap.add_argument("--model", default="", help="as `orcinus serve --model` (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/memory/load_bundled.json")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    report = {"model": args.model or "the bundled model", "samples": {str(t): [] for t in trees}, "median": {}}
    scratch = tempfile.TemporaryDirectory(prefix="orcinus-load-memory-")
    extensions = {t: tempfile.mkdtemp(dir=scratch.name) for t in trees}
    for tree in trees:
        probe(tree, args.model, extensions[tree])  # a warm-up that builds the ops: not a sample
    for _ in range(args.rounds):
        for tree in trees:
            samples = report["samples"][str(tree)]
            samples.append(probe(tree, args.model, extensions[tree]))
            report["median"][str(tree)] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            write_report(args.out, report)
            print(
                f"{tree}: peak {samples[-1]['peak_mib']:.0f} MiB, after {samples[-1]['after_mib']:.0f} MiB, "
                f"{samples[-1]['seconds']:.1f} s",
                flush=True,
            )
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
