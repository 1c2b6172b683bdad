"""Orcinus beside llama.cpp's `llama-server` on the same GGUF: closed-loop streaming clients at several
concurrency levels, every system driven by `bench_serving.py`, runs interleaved, medians over repeats.

Start the peer first (../shared/peers/README.md: build_llama_server.sh, then start_llama_server.sh), then:

    python loadtest/compare_llama_server.py --out benchmarks/vs_llama_server.json \\
        --variant default= --variant passive=OMP_WAIT_POLICY=PASSIVE

Each variant is an `orcinus serve` with those flags (the empty one: the defaults a user gets); leading
KEY=VALUE words set its environment (e.g. "OMP_WAIT_POLICY=ACTIVE --num-threads 2"). Prompts
are random token ids with a new seed for every run, so llama-server's prompt cache never hits within a
run; restart llama-server (or pass another --seed-base) before running again, or its slots still hold
the last run's prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "loadtest"))

from local_server import launch_server, stop_server  # noqa: E402


def bench(url: str, model: str, concurrency: int, args, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "loadtest/bench_serving.py", "--base-url", url, "--model", model,
               "--num-prompts", str(max(args.min_prompts, args.prompts_per_client * concurrency)),
               "--max-concurrency", str(concurrency), "--input-len", *map(str, args.input_len),
               "--output-len", *map(str, args.output_len), "--seed", str(seed), "--out", f.name]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_serving failed against {url}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        s = json.loads(Path(f.name).read_text())["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_s": s["ttft_s"]["p50"], "itl_p99_s": s["itl_s"]["p99"],
            "completed": s["completed"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-url", default="http://127.0.0.1:8101")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="an orcinus serve configuration (repeatable; default: one with no flags)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-client", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 284], help="~150 prompt tokens on average")
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed-base", type=int, default=1000, help="runs use seeds from here up")
    ap.add_argument("--out", default="benchmarks/vs_llama_server.json")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant) or {"default": ""}

    servers = {}
    for name, flags in variants.items():
        words = shlex.split(flags)
        env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
        servers[name] = launch_server([w for w in words if not ("=" in w and not w.startswith("-"))], env=env)
    systems = {"llama-server": (args.llama_url, "smollm2-135m")}
    systems |= {f"orcinus {name}": (url, "SmolLM2-135M-Instruct") for name, (_, url) in servers.items()}
    samples: dict = {c: {s: [] for s in systems} for c in args.concurrency}
    seed = args.seed_base
    try:
        for name, (url, model) in systems.items():  # warm-up: first requests, allocator, threads
            bench(url, model, 4, args, seed := seed + 1)
        for rep in range(args.repeats):
            for c in args.concurrency:
                for name, (url, model) in systems.items():  # interleaved: drift hits every system alike
                    r = bench(url, model, c, args, seed := seed + 1)
                    samples[c][name].append(r)
                    print(f"repeat {rep} c={c:<3} {name:<28} {r['output_tok_s']:7.1f} tok/s  "
                          f"TTFT p50 {r['ttft_p50_s']:.3f} s  ITL p99 {r['itl_p99_s']:.3f} s", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)

    table = {}
    for c, by_system in samples.items():
        med = {s: {k: statistics.median(r[k] for r in runs) for k in ("output_tok_s", "ttft_p50_s", "itl_p99_s")}
               for s, runs in by_system.items()}
        for s in med:
            med[s]["vs_llama_server"] = med[s]["output_tok_s"] / med["llama-server"]["output_tok_s"]
        table[c] = med
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    report = {"command": "python " + " ".join(map(shlex.quote, sys.argv)), "variants": variants,
              "machine": {"cpu": cpu.stdout.strip(), "cores": os.cpu_count(), "llama_server": "b11434, 32 slots, 2 threads"},
              "workload": {"input_len": args.input_len, "output_len": args.output_len,
                           "prompts_per_client": args.prompts_per_client, "repeats": args.repeats},
              "medians": table, "samples": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'clients':>7}  {'system':<28}{'tok/s':>8}{'ratio':>7}{'TTFT p50':>10}{'ITL p99':>9}")
    for c, med in table.items():
        for s, m in med.items():
            print(f"{c:>7}  {s:<28}{m['output_tok_s']:>8.1f}{m['vs_llama_server']:>6.2f}x"
                  f"{m['ttft_p50_s']:>9.3f}s{m['itl_p99_s']:>8.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
