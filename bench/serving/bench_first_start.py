"""Seconds from `orcinus serve` to a healthy /health: first on a machine that has never built the C++ ops (a fresh
TORCH_EXTENSIONS_DIR), then again with them cached. Each checkout given is timed in turn, interleaved per round. A
checkout whose install built the ops (`make install`) compiles nothing at either start: time such trees to compare
installs, and trees without the ops built in place to compare run-time builds.

    python -m bench.serving.bench_first_start --trees . /tmp/old-checkout --rounds 2 \\
        --out benchmarks/results/startup/first_start.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import served, write_report


def time_to_healthy(tree: Path, extensions: str, flags: list[str]) -> float:
    start = time.perf_counter()
    with served(flags, timeout=900, env={"TORCH_EXTENSIONS_DIR": extensions}, root=tree):
        return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to start `orcinus serve` from"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flags", default="", help="extra `orcinus serve` flags")
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="time only starts with the C++ ops already built (each tree builds them once, untimed)",
    )
    ap.add_argument("--out", default="benchmarks/results/startup/first_start.json")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    report = {"samples_s": {str(t): {"first": [], "cached": []} for t in trees}, "median_s": {}}
    # --cached-only: one extensions folder per tree for the whole run, its ops built by one untimed start.
    kept = {t: tempfile.mkdtemp(prefix="orcinus-ext-") for t in trees} if args.cached_only else {}
    for tree, ext in kept.items():
        time_to_healthy(tree, ext, args.flags.split())
    for _ in range(args.rounds):
        for tree in trees:
            ext = kept.get(tree) or tempfile.mkdtemp(prefix="orcinus-ext-")
            samples = report["samples_s"][str(tree)]
            if not args.cached_only:
                samples["first"].append(time_to_healthy(tree, ext, args.flags.split()))
            samples["cached"].append(time_to_healthy(tree, ext, args.flags.split()))
            if tree not in kept:
                shutil.rmtree(ext, ignore_errors=True)
            report["median_s"][str(tree)] = {k: statistics.median(v) for k, v in samples.items() if v}
            write_report(args.out, report)
            first = f"first start {samples['first'][-1]:.1f} s, " if samples["first"] else ""
            print(f"{tree}: {first}cached {samples['cached'][-1]:.1f} s", flush=True)
    for ext in kept.values():
        shutil.rmtree(ext, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
