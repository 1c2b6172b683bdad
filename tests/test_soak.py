"""bench/serving/soak.py in a few seconds against the shared live server: Locust's CSVs, the RSS samples and plot,
and a summary. The real soak runs for 10 minutes; this checks that every output it will need is there."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_soak_smoke_run_writes_rss_samples_plot_and_locust_csvs(server, tmp_path):
    # A subprocess, as the real run: locust must never be imported into pytest (gevent patches everything).
    out = tmp_path / "soak"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.serving.soak",
            "--base-url",
            server,
            "--duration",
            "4",
            "--interval",
            "1",
            "--users",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "rss.csv")))
    assert len(rows) >= 5, rows
    assert all(float(r["gateway_rss_mib"]) > 10 and float(r["engine_rss_mib"]) > 10 for r in rows), rows
    # The engine reports both figures from one reading: the shared ring pages are in RSS, not in the private one.
    # The gateway's two come from separate reads of a growing process (prometheus' collector, then ours).
    assert all(10 < float(r["engine_private_mib"]) < float(r["engine_rss_mib"]) for r in rows), rows
    assert all(float(r["gateway_private_mib"]) > 10 for r in rows), rows
    assert float(rows[-1]["requests_finished"]) > 0
    assert [float(r["elapsed_s"]) for r in rows] == sorted(float(r["elapsed_s"]) for r in rows)
    # The samples saw the load: a counter, since a gauge of sequences in flight can read 0 at every sample on a
    # fast machine (4 users, 8-48 tokens a reply, 0.1-1 s between requests).
    assert float(rows[-1]["generation_tokens"]) > float(rows[0]["generation_tokens"]), rows
    assert all(math.isfinite(float(r[c])) for r in rows for c in ("sequences_admitted", "requests_running")), rows
    assert (out / "rss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("locust_stats.csv", "locust_stats_history.csv", "locust_failures.csv"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["locust"]["requests"] > 0 and summary["locust"]["failures"] == 0, summary["locust"]
    assert summary["locust_exit_code"] == 0 and summary["engine_restarts"] == 0
    assert set(summary["rss"]) == {"gateway_rss_mib", "engine_rss_mib", "gateway_private_mib", "engine_private_mib"}
