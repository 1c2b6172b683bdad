"""loadtest/bench_gpu.py runs end to end (its CPU smoke mode) and writes every section of its report."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_bench_gpu_quick_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "loadtest/bench_gpu.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    a = report["graphs_vs_eager"]
    # The CPU stand-ins of both graph runners reproduce eager tokens exactly.
    assert a["piecewise"]["identical"] == a["whole"]["identical"] == a["requests"] == 4
    assert [(r["shape"], r["batch"]) for r in report["decode_steps"]] == [("smollm2-135m", 1), ("smollm2-135m", 2)]
    assert all(r["eager_ms"] > 0 and r["piecewise_ms"] > 0 and r["graphs_ms"] > 0 and r["floor_ms"] > 0
               for r in report["decode_steps"])
    t = report["throughput"]
    assert t["requests"] == 6 and set(t["median_tok_s"]) == {
        "orcinus", "orcinus_capped", "orcinus_request_level", "transformers"}
    # With every request admitted at once both schedulers would run one schedule: (d) caps the batch below it.
    assert t["capped_seqs"] < t["requests"] <= t["max_num_seqs"]
    assert a["dtype"] == "float32"
    assert proc.stdout.splitlines()[-2].startswith("(d) max 2 seqs: iteration-level")  # the table comes last
