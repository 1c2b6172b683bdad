"""aiperf and guidellm against `orcinus serve` (issue 29), with the tokenizer `orcinus export-tokenizer` writes: every
request succeeds, and the token counts each client makes with that tokenizer are the server's own (`usage`), so
neither warns of a mismatch. Each client is installed from PyPI into its own venv, as a user would (created if
missing):

    python -m bench.clients.check_aiperf_guidellm --out benchmarks/results/clients/aiperf_guidellm.json

The workload is small (its point is that the clients work, not speed: on 2 cores the clients' own processes take
much of the CPU): 100-token synthetic prompts, 32 output tokens, 4 concurrent streams.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, served, write_report

MODEL = "SmolLM2-135M-Instruct"
PROMPT_TOKENS, OUTPUT_TOKENS, STREAMS = 100, 32, 4
WARNING = re.compile(r"mismatch|token count", re.IGNORECASE)


def ensure_venv(path: Path, package: str) -> Path:
    """The client's console script in its own venv, installing `package` there first if it is missing."""
    script = path / "bin" / package
    if not script.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "pip"), "install", "-q", package], check=True)
    return script


def version(venv: Path, package: str) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", (f"import importlib.metadata as m; print(m.version({package!r}))")],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def aiperf(script: Path, base: str, tokenizer: Path, work: Path, server_counts: bool) -> dict:
    """Completions, streamed; token counts from the tokenizer, or with --use-server-token-count from `usage`."""
    out = work / ("aiperf-server-counts" if server_counts else "aiperf")
    cmd = [
        str(script),
        "profile",
        "--model",
        MODEL,
        "--url",
        base,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--request-count",
        "16",
        "--concurrency",
        str(STREAMS),
        "--synthetic-input-tokens-mean",
        str(PROMPT_TOKENS),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(OUTPUT_TOKENS),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--ui-type",
        "none",
        "--artifact-dir",
        str(out),
    ] + ["--use-server-token-count"] * server_counts
    done = run(cmd, work)
    metrics = json.loads((out / "profile_export_aiperf.json").read_text())
    # Its own counts (the tokenizer's, or usage's) beside the server's usage: they must be the same numbers.
    counts = {
        k: {s: metrics[k][s] for s in ("avg", "min", "max")}
        for k in ("input_sequence_length", "output_sequence_length", "usage_prompt_tokens", "usage_completion_tokens")
        if k in metrics
    }
    return {
        "command": shlex.join(cmd),
        "requests": metrics["request_count"]["avg"],
        "errors": metrics.get("error_summary"),
        "token_counts": counts,
        "mismatch_lines": mismatch_lines(done),
    }


def guidellm(script: Path, base: str, tokenizer: Path, work: Path, route: str) -> dict:
    out = work / f"guidellm{route.replace('/', '-')}.json"
    cmd = [
        str(script),
        "run",
        "--backend",
        f"kind=openai_http,target={base},model={MODEL},request_format={route}",
        "--profile",
        f"kind=concurrent,streams={STREAMS}",
        "--constraint",
        "kind=max_requests,count=16",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    done = run(cmd, work)
    [bench] = json.loads(out.read_text())["benchmarks"]
    m = bench["metrics"]
    tokens = {
        name: {s: m[name]["successful"][s] for s in ("min", "median", "max")}
        for name in ("prompt_token_count", "output_token_count")
    }
    return {
        "command": shlex.join(cmd),
        "requests": m["request_totals"],
        "token_counts": tokens,
        "warnings": bench.get("warnings"),
        "mismatch_lines": mismatch_lines(done),
    }


def mismatch_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if WARNING.search(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venvs", default="/tmp", help="aiperf's and guidellm's venvs go here (created if missing)")
    ap.add_argument("--out", default="benchmarks/results/clients/aiperf_guidellm.json")
    args = ap.parse_args()
    venvs = Path(args.venvs)
    clients = {name: ensure_venv(venvs / name, name) for name in ("aiperf", "guidellm")}
    work = Path(tempfile.mkdtemp(prefix="orcinus-clients-"))
    tokenizer = work / "tokenizer"
    subprocess.run([str(ROOT / ".venv" / "bin" / "orcinus"), "export-tokenizer", str(tokenizer)], check=True)
    with served([]) as base:
        result = {
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "versions": {name: version(venvs / name, name) for name in clients},
            "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "streams": STREAMS},
            "aiperf": aiperf(clients["aiperf"], base, tokenizer, work, server_counts=False),
            "aiperf_server_counts": aiperf(clients["aiperf"], base, tokenizer, work, server_counts=True),
            "guidellm_completions": guidellm(clients["guidellm"], base, tokenizer, work, "/v1/completions"),
            "guidellm_chat": guidellm(clients["guidellm"], base, tokenizer, work, "/v1/chat/completions"),
        }
    write_report(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
