"""Orcinus beside llama.cpp's `llama-server` on the same GGUF: closed-loop streaming clients at several
concurrency levels, every system driven by `bench_serving.py`, runs interleaved, medians over rounds.

Controlled: in a round every system gets the same prompts and output lengths (one seed per round and
concurrency, shared), each point runs for `--seconds` (60 by default: long enough for a steady state), the
order of the systems rotates from round to round, and the peer's own command line and `/props` are recorded.

Start the peer first (bench/peers/README.md: build_llama_server.sh, then start_llama_server.sh), then:

    python -m bench.serving.compare_llama_server --out benchmarks/results/serving/vs_llama_server.json \\
        --variant default= --variant passive=OMP_WAIT_POLICY=PASSIVE

Another GGUF: start the peer on it (MODEL=F start_llama_server.sh) and pass `--model F`; every variant serves it.

Each variant is an `orcinus serve` with those flags (the empty one: the defaults a user gets); leading
KEY=VALUE words set its environment (e.g. "OMP_WAIT_POLICY=ACTIVE --num-threads 2"). Prompts
are random token ids with a new seed for every round, so neither server's prompt cache hits within a
round; restart llama-server (or pass another --seed-base) before running again, or its slots still hold
the last run's prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.common import ROOT, served, write_report

# ITL is per SSE event (a speculating server sends several tokens in one); TPOT is per token: (e2e - TTFT) / (n - 1)
METRICS = ("output_tok_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s")


def bench(url: str, model: str, concurrency: int, args, seed: int, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable,
            "-m",
            "bench.serving.bench_serving",
            "--base-url",
            url,
            "--model",
            model,
            "--duration",
            str(seconds),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            *map(str, args.input_len),
            "--output-len",
            *map(str, args.output_len),
            "--seed",
            str(seed),
            "--out",
            f.name,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 900)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_serving failed against {url}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        s = json.loads(Path(f.name).read_text())["summary"]
    return {
        "output_tok_s": s["output_throughput"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "itl_p50_s": s["itl_s"]["p50"],
        "itl_p99_s": s["itl_s"]["p99"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "completed": s["completed"],
        "load_average_1m": os.getloadavg()[0],  # the machine may be shared: what else ran beside the point
        "duration_s": s["duration_s"],
        "seed": seed,
    }


def peer_settings(url: str) -> dict:
    """llama-server's settings as it reports them: its command line (from /proc) and its /props."""
    port = url.rsplit(":", 1)[-1].strip("/")
    cmdline = None
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [w.decode(errors="replace") for w in words if w]
        if args and Path(args[0]).name == "llama-server" and port in args:
            cmdline = args
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/props", timeout=10) as r:
            props = json.loads(r.read())
    except OSError as e:
        props = {"error": str(e)}
    keep = ("build_info", "total_slots", "model_path", "n_ctx")
    return {"cmdline": cmdline, "props": {k: v for k, v in props.items() if k in keep or k == "error"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-url", default="http://127.0.0.1:8101")
    ap.add_argument("--llama-model-name", default="smollm2-135m", help="the peer's --alias")
    ap.add_argument("--model", default=None, help="the GGUF every variant serves (default: the bundled model)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an orcinus serve configuration (repeatable; default: one with no flags)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=60.0, help="closed-loop time per point (steady state)")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 284], help="~150 prompt tokens on average")
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--seed-base", type=int, default=1000, help="rounds use seeds from here up")
    ap.add_argument("--out", default="benchmarks/results/serving/vs_llama_server.json")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant) or {"default": ""}

    with contextlib.ExitStack() as servers:  # not served_all: each variant has an environment of its own
        systems = {"llama-server": (args.llama_url, args.llama_model_name)}
        served_name = Path(args.model).stem if args.model else "SmolLM2-135M-Instruct"
        model_flags = ["--model", args.model, "--served-model-name", served_name] if args.model else []
        for name, flags in variants.items():
            words = model_flags + shlex.split(flags)
            env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
            url = servers.enter_context(served([w for w in words if not ("=" in w and not w.startswith("-"))], env=env))
            systems[f"orcinus {name}"] = (url, served_name)
        samples: dict = {c: {s: [] for s in systems} for c in args.concurrency}
        peer = peer_settings(args.llama_url)
        names = list(systems)
        for i, (url, model) in enumerate(systems.values()):  # warm-up: first requests, allocator, threads
            bench(url, model, 4, args, args.seed_base - 1 - i, min(10.0, args.seconds))
        for rep in range(args.repeats):
            for c in args.concurrency:
                seed = args.seed_base + 1000 * rep + c  # one per round and point, the same for every system
                for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each round another order
                    url, model = systems[name]
                    r = bench(url, model, c, args, seed, args.seconds)
                    samples[c][name].append(r)
                    print(
                        f"round {rep} c={c:<3} {name:<28} {r['output_tok_s']:7.1f} tok/s  "
                        f"TTFT p50 {r['ttft_p50_s']:.3f} s  ITL p50 {r['itl_p50_s'] * 1000:.1f} ms  "
                        f"p99 {r['itl_p99_s']:.3f} s",
                        flush=True,
                    )

    table = {}
    for c, by_system in samples.items():
        med = {s: {k: statistics.median(r[k] for r in runs) for k in METRICS} for s, runs in by_system.items()}
        for m in med.values():
            m["vs_llama_server"] = m["output_tok_s"] / med["llama-server"]["output_tok_s"]
        table[c] = med
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    report = {
        "model": args.model or "the bundled model",
        "variants": variants,
        "machine": {"cpu": cpu.stdout.strip(), "cores": os.cpu_count()},
        "llama_server": peer,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seconds": args.seconds,
            "rounds": args.repeats,
        },
        "medians": table,
        "samples": samples,
    }
    write_report(args.out, report)
    print(
        f"\n{'clients':>7}  {'system':<28}{'tok/s':>8}{'ratio':>7}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
    )
    for c, med in table.items():
        for s, m in med.items():
            print(
                f"{c:>7}  {s:<28}{m['output_tok_s']:>8.1f}{m['vs_llama_server']:>6.2f}x"
                f"{m['ttft_p50_s']:>9.3f}s{m['itl_p50_s'] * 1000:>7.1f}ms{m['itl_p99_s']:>8.3f}s"
                f"{m['tpot_p50_s'] * 1000:>8.1f}ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
