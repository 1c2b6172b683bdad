"""bench/gpu/bench_gpu.py runs end to end (its CPU smoke mode) and writes every section of its report."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_bench_gpu_quick_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.bench_gpu", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    a = report["graphs_vs_eager"]
    # The CPU stand-ins of both graph runners reproduce eager tokens exactly.
    assert a["piecewise"]["identical"] == a["whole"]["identical"] == a["requests"] == 4
    # Each mode's steps ran the path it names, and the report says what ran.
    assert set(a["steps_by_path"]) == {"eager", "piecewise", "whole"} and all(a["steps_by_path"].values())
    assert "whole-step graphs" in a["runner"] and all("runner" in r for r in report["decode_steps"])
    assert [(r["shape"], r["batch"]) for r in report["decode_steps"]] == [("tiny", 1), ("tiny", 2)]
    assert all(
        r["eager_ms"] > 0 and r["piecewise_ms"] > 0 and r["graphs_ms"] > 0 and r["floor_ms"] > 0
        for r in report["decode_steps"]
    )
    assert report["complete"] and report["bandwidth_timer"] == "perf_counter"  # CUDA events on a GPU
    t = report["throughput"]
    systems = {"orcinus", "orcinus_capped", "orcinus_request_level", "transformers"}
    assert t["requests"] == 6 and set(t["median_tok_s"]) == set(t["first_run_tok_s"]) == systems
    # The first full run is the warm-up, reported apart: the medians are over the warm runs alone.
    assert all(len(t["samples_tok_s"][s]) == t["warm_runs"] == 1 for s in systems)
    assert all(t["median_tok_s"][s] == t["samples_tok_s"][s][0] for s in systems)
    # With every request admitted at once both schedulers would run one schedule: (d) caps the batch below it.
    assert t["capped_seqs"] < t["requests"] <= t["max_num_seqs"]
    assert a["dtype"] == "float32"
    assert proc.stdout.splitlines()[-2].startswith("(d) max 2 seqs: iteration-level")  # the table comes last


def test_reports_are_replaced_whole(tmp_path):
    from bench.common import write_json

    out = tmp_path / "sub" / "report.json"
    write_json(out, {"rows": [1]})
    write_json(out, {"rows": [1, 2], "ratio": None})
    assert json.loads(out.read_text()) == {"rows": [1, 2], "ratio": None}
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]  # no temporary file left beside it
