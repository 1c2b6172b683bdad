"""Seconds from `orcinus serve` to a healthy /health: first on a machine that has never built the C++ ops (a fresh
TORCH_EXTENSIONS_DIR), then again with them cached. Each checkout given is timed in turn, interleaved per round.

    python loadtest/bench_first_start.py --trees . /tmp/old-checkout --rounds 2 --out benchmarks/first_start.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import write_json  # noqa: E402
from local_server import launch_server, stop_server  # noqa: E402
from provenance import provenance  # noqa: E402


def time_to_healthy(tree: Path, extensions: str, flags: list[str]) -> float:
    start = time.perf_counter()
    proc, _ = launch_server(flags, timeout=900, env={"TORCH_EXTENSIONS_DIR": extensions}, root=tree)
    elapsed = time.perf_counter() - start
    stop_server(proc)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to start `orcinus serve` from")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flags", default="", help="extra `orcinus serve` flags")
    ap.add_argument("--out", default="benchmarks/first_start.json")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    report = {"command": "python " + " ".join(sys.argv), "machine": platform.platform(), **provenance(),
              "samples_s": {str(t): {"first": [], "cached": []} for t in trees}, "median_s": {}}
    for _ in range(args.rounds):
        for tree in trees:
            with tempfile.TemporaryDirectory(prefix="orcinus-ext-") as ext:
                samples = report["samples_s"][str(tree)]
                samples["first"].append(time_to_healthy(tree, ext, args.flags.split()))
                samples["cached"].append(time_to_healthy(tree, ext, args.flags.split()))
                report["median_s"][str(tree)] = {k: statistics.median(v) for k, v in samples.items()}
                write_json(args.out, report)
                print(f"{tree}: first start {samples['first'][-1]:.1f} s, cached {samples['cached'][-1]:.1f} s",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
