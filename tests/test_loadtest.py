"""The load-test tools run against a live server: Locust headless, and bench_serving on a tiny workload."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_locust_headless_records_requests_and_no_failures(server, tmp_path):
    # Never import locust here: it monkey-patches the process with gevent (and deadlocks pytest).
    if not (BIN / "locust").exists():
        pytest.skip("locust is not installed")
    prefix = tmp_path / "run"
    proc = subprocess.run(
        [
            str(BIN / "locust"),
            "-f",
            str(ROOT / "bench" / "serving" / "locustfile.py"),
            "--host",
            server,
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "8s",
            "--csv",
            str(prefix),
            "--only-summary",
            "--stop-timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    total = rows[("", "Aggregated")]
    assert int(total["Request Count"]) > 0
    assert int(total["Failure Count"]) == 0, open(f"{prefix}_failures.csv").read()
    assert int(rows[("METRIC", "TTFT")]["Request Count"]) > 0  # the custom metrics are recorded
    assert int(rows[("METRIC", "tokens/s")]["Request Count"]) > 0


def bench_serving(server: str, out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """bench_serving against `server` on a tiny workload (8-24 prompt tokens, 2-6 outputs): its output and report."""
    argv = ["--base-url", server, "--input-len", "8", "24", "--output-len", "2", "6", *flags, "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serving.bench_serving", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_bench_serving_tiny_workload(server, tmp_path):
    proc, report = bench_serving(server, tmp_path / "bench.json", "--num-prompts", "6", "--request-rate", "4")
    s = report["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r["max_tokens"] for r in report["requests"])  # ignore_eos honoured
    assert all(r["ttft"] > 0 and r["output_tokens"] == r["max_tokens"] for r in report["requests"])
    assert "normalized_latency_s" in proc.stdout


def test_bench_serving_timed_closed_loop_sends_the_same_requests_to_any_server(server, tmp_path):
    """A timed run (how compare_llama_server.py drives both servers) takes the seeded requests in order."""
    from bench.serving.bench_serving import Workload

    flags = ["--duration", "2", "--max-concurrency", "2", "--seed", "5"]
    _, report = bench_serving(server, tmp_path / "timed.json", *flags)
    assert report["summary"]["completed"] >= 2 and report["summary"]["failed"] == 0
    stream = Workload(input_len=(8, 24), output_len=(2, 6), seed=5).stream()
    expected = [next(stream) for _ in report["requests"]]
    assert sorted((r["prompt_len"], r["max_tokens"]) for r in report["requests"]) == sorted(
        (len(p), m) for p, m in expected
    )
