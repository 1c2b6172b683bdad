"""Soak: Locust at saturation against an Orcinus server for a given time, watching both processes' memory.

Starts `orcinus serve` on loopback (or uses --base-url), runs Locust headless as a subprocess with as
many users as the server admits at once (max-num-seqs + max-waiting), and every --interval seconds
reads the gateway's and the engine's resident memory from /metrics into rss.csv. At the end it writes
rss.png, Locust's CSVs (locust_*.csv) and summary.json into --out; a server it started is stopped with
SIGTERM and checked for shared-memory segments left in /dev/shm.

    python -m bench.serving.soak --duration 600 --out benchmarks/results/serving/soak

Locust never runs in this process: it monkey-patches everything with gevent.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, launch_server, scrape_metrics, stop_server, write_report

LOCUST = Path(sys.executable).parent / "locust"
MIB = 2**20
# One sample: seconds since the start, then what /metrics says.
COLUMNS = [
    "elapsed_s",
    "gateway_rss_mib",
    "engine_rss_mib",
    "gateway_private_mib",
    "engine_private_mib",
    "requests_finished",
    "sequences_admitted",
    "requests_running",
    "requests_waiting",
    "kv_blocks_used",
    "generation_tokens",
    "requests_rejected",
    "engine_restarts",
]
METRICS = {
    "gateway_rss_mib": "process_resident_memory_bytes",
    "engine_rss_mib": "orcinus_engine_resident_memory_bytes",
    "gateway_private_mib": "orcinus_gateway_private_memory_bytes",
    "engine_private_mib": "orcinus_engine_private_memory_bytes",
    "sequences_admitted": "orcinus_sequences_admitted",
    "requests_running": "orcinus_requests_running",
    "requests_waiting": "orcinus_requests_waiting",
    "kv_blocks_used": "orcinus_kv_blocks_used",
    "generation_tokens": "orcinus_generation_tokens_total",
    "requests_rejected": "orcinus_requests_rejected_total",
    "engine_restarts": "orcinus_engine_restarts_total",
}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting)]
    if args.model:
        flags += ["--model", args.model]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    log = open(Path(args.out) / "server.log", "wb")
    return launch_server(flags, log, timeout=300)


def sample(url: str, headers: dict, started: float) -> dict:
    values = scrape_metrics(url, headers)
    row = {"elapsed_s": round(time.monotonic() - started, 1)}
    for column, name in METRICS.items():
        value = values.get(name, float("nan"))
        row[column] = round(value / MIB, 3) if column.endswith("_mib") else value
    # One series per finish reason: their sum counts every finished sequence.
    row["requests_finished"] = sum(v for k, v in values.items() if k.startswith("orcinus_requests_finished_total"))
    return row


def first_sample(url: str, headers: dict, started: float) -> dict:
    """The baseline before any load, once the engine has reported its memory (about once a second)."""
    deadline = time.monotonic() + 30
    # Absent (nan) until the engine's first report, then 0 until it has read its memory: `not > 0` waits for both.
    while not (row := sample(url, headers, started))["engine_rss_mib"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return row


def run_locust(url: str, users: int, duration: int, out: Path) -> subprocess.Popen:
    cmd = [
        str(LOCUST),
        "-f",
        str(ROOT / "bench" / "serving" / "locustfile.py"),
        "--host",
        url,
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{duration}s",
        "--csv",
        str(out / "locust"),
        "--csv-full-history",
        "--only-summary",
        "--stop-timeout",
        "60",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / "locust.log", "wb"), stderr=subprocess.STDOUT)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["elapsed_s"] / 60 for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for ax, process in ((axes[0], "gateway"), (axes[1], "engine")):
        for column, what in ((f"{process}_rss_mib", "RSS"), (f"{process}_private_mib", "RSS less shared memory")):
            values = [r[column] for r in rows]
            ax.plot(t, values, "o-", ms=3, label=f"{process} {what} ({values[-1] - values[0]:+.2f} MiB)")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[1].set_xlabel("minutes")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def locust_totals(out: Path) -> dict:
    """Per route: requests, failures, median and p95 (ms). Locust's Aggregated row would mix in the
    locustfile's custom TTFT and tokens/s rows."""
    routes = {}
    for r in csv.DictReader(open(out / "locust_stats.csv")):
        if r["Type"] == "POST":
            routes[r["Name"]] = {
                "requests": int(r["Request Count"]),
                "failures": int(r["Failure Count"]),
                "median_ms": float(r["Median Response Time"] or 0),
                "p95_ms": float(r["95%"] or 0),
            }
    failures = {}
    if (out / "locust_failures.csv").exists():
        for r in csv.DictReader(open(out / "locust_failures.csv")):
            failures[r["Error"][:120]] = failures.get(r["Error"][:120], 0) + int(r["Occurrences"])
    return {
        "requests": sum(r["requests"] for r in routes.values()),
        "failures": sum(r["failures"] for r in routes.values()),
        "routes": routes,
        "failures_by_error": failures,
    }


# RSS, and RSS less the shared-memory pages of the channel rings: those count once a process has touched them, so
# RSS climbs by up to the rings' 8 MiB before it flattens (engine/ipc/memory.py). A leak shows in the private part.
MEMORY_COLUMNS = ("gateway_rss_mib", "engine_rss_mib", "gateway_private_mib", "engine_private_mib")


def summarize(rows: list[dict], warmup_requests: int) -> dict:
    """Start, end and peak of each process's RSS, and its growth per finished request after the warm-up (first
    batches, allocator pools, the prefix cache filling up are not a leak; what keeps growing after them is):
    the least-squares slope of RSS against requests finished, over the samples past `warmup_requests`."""
    out = {}
    after = [r for r in rows if r["requests_finished"] >= warmup_requests]
    x = [r["requests_finished"] for r in after]
    for column in MEMORY_COLUMNS:
        values = [r[column] for r in rows]
        loaded = values[1:] or values  # the first sample is taken before Locust's users arrive
        out[column] = {
            "before_load": values[0],
            "last": values[-1],
            "max": max(values),
            "growth_under_load": round(loaded[-1] - loaded[0], 3),
        }
        if len(set(x)) >= 3:
            fit = statistics.linear_regression(x, [r[column] * MIB / 1024 for r in after])  # KiB per request
            out[column] |= {
                "requests_after_warmup": x[-1] - x[0],
                "growth_after_warmup_mib": round(after[-1][column] - after[0][column], 3),
                "kib_per_request_after_warmup": round(fit.slope, 4),
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--duration", type=int, default=600, help="seconds of load")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--users", type=int, default=None, help="Locust users (default: max-num-seqs + max-waiting)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="for a server this script starts")
    ap.add_argument("--max-waiting", type=int, default=16, help="for a server this script starts")
    ap.add_argument("--model", default=None, help="for a server this script starts (default: the bundled model)")
    # Locust shares the machine: an engine with more torch threads than free cores spins and slows 10x or more.
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads of a server this script starts")
    ap.add_argument("--api-key", default=os.environ.get("ORCINUS_API_KEY"), help="for /metrics if it needs one")
    ap.add_argument("--warmup-requests", type=int, default=1000, help="finished requests before RSS growth counts")
    ap.add_argument("--out", default="benchmarks/results/serving/soak", help="output directory")
    args = ap.parse_args()
    if not LOCUST.exists():
        sys.exit(f"{LOCUST} not found: pip install -e '.[test]'")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, url = (None, args.base_url) if args.base_url else start_server(args)
    users = args.users or args.max_num_seqs + args.max_waiting
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: list[dict] = []
    leaked: list[str] | None = None
    started = time.monotonic()
    try:
        rows.append(first_sample(url, headers, started))
        locust = run_locust(url, users, args.duration, out)
        next_at = started + args.interval
        while locust.poll() is None:
            time.sleep(max(0.0, min(next_at - time.monotonic(), 1.0)))
            if time.monotonic() >= next_at:
                rows.append(sample(url, headers, started))
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
                next_at += args.interval
        rows.append(sample(url, headers, started))
    finally:
        if proc is not None:
            leaked = stop_server(proc, timeout=120)

    with open(out / "rss.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    title = f"Orcinus soak: {users} Locust users for {args.duration} s"
    plot(rows, out / "rss.png", title)
    summary = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "server": url
        if args.base_url
        else {
            "max_num_seqs": args.max_num_seqs,
            "max_waiting": args.max_waiting,
            "num_threads": args.num_threads,
            "model": args.model or "bundled SmolLM2-135M-Instruct",
        },
        "users": users,
        "duration_s": args.duration,
        "interval_s": args.interval,
        "locust_exit_code": locust.returncode,
        "locust": locust_totals(out),
        "rss": summarize(rows, args.warmup_requests),
        "engine_restarts": rows[-1]["engine_restarts"] - rows[0]["engine_restarts"],
        "shm_segments_left": leaked,
    }
    write_report(out / "summary.json", summary)
    print(json.dumps({k: summary[k] for k in ("locust", "rss", "engine_restarts", "shm_segments_left")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
