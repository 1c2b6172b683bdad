"""A lone stream's decode cost on each server as CPU time per token: the CPU seconds the server's processes spend
on a request of N tokens less those on one of 1 token (the same prompt length), over N - 1. CPU time counts the
work and not the waits for a core, so it holds on a shared machine where wall-clock figures do not; give both
servers one thread (llama-server `-t 1`, Orcinus `--num-threads 1`) so that no thread spins waiting for another.

    THREADS=1 NP=1 MODEL=F ALIAS=NAME bench/peers/start_llama_server.sh
    python -m bench.serving.lone_stream_cpu --model F --llama-model-name NAME \\
        --out benchmarks/results/models/lone_stream_cpu_NAME.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.common import launch_server, stop_server, write_report
from bench.serving.compare_llama_server import peer_settings

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of `root` and every process below it."""
    parent, ticks = {}, {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        ticks[int(d.name)] = int(fields[11]) + int(fields[12])
    members, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in members} - members
        members |= more
        grew = bool(more)
    return sum(ticks.get(p, 0) for p in members) / TICK


def request_cpu(url: str, model: str, pid: int, prompt: list[int], tokens: int) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, completion tokens) of one completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    c0, t0 = tree_cpu_seconds(pid), time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    wall = time.perf_counter() - t0
    return tree_cpu_seconds(pid) - c0, wall, r.json()["usage"]["completion_tokens"]


def measure(url: str, model: str, pid: int, args, rng: random.Random) -> dict:
    def prompt() -> list[int]:  # fresh ids: no prompt cache hit
        return [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]

    request_cpu(url, model, pid, prompt(), 8)  # warm-up
    per_token, walls = [], []
    for _ in range(args.rounds):
        one = request_cpu(url, model, pid, prompt(), 1)
        many = request_cpu(url, model, pid, prompt(), args.tokens)
        per_token.append((many[0] - one[0]) / (many[2] - one[2]) * 1000)
        walls.append((many[1] - one[1]) / (many[2] - one[2]) * 1000)
    return {
        "cpu_ms_per_token": statistics.median(per_token),
        "wall_ms_per_token": statistics.median(walls),
        "samples_cpu_ms": per_token,
        "samples_wall_ms": walls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the GGUF Orcinus serves (default: the bundled model)")
    ap.add_argument("--llama-url", default="http://127.0.0.1:8101")
    ap.add_argument("--llama-model-name", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="Orcinus --num-threads (start llama-server with as many)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    peer = peer_settings(args.llama_url)
    pid = next(int(d.name) for d in Path("/proc").glob("[0-9]*") if _cmdline(d) == peer["cmdline"])
    name = Path(args.model).stem if args.model else "SmolLM2-135M-Instruct"
    flags = ["--num-threads", str(args.threads), "--speculative", "off", "--served-model-name", name]
    proc, url = launch_server(flags + (["--model", args.model] if args.model else []))
    try:
        results = {
            "llama-server": measure(args.llama_url, args.llama_model_name, pid, args, rng),
            "orcinus": measure(url, name, proc.pid, args, rng),
        }
    finally:
        stop_server(proc)
    report = {
        "model": args.model or "the bundled model",
        "llama_server": peer,
        "tokens": args.tokens,
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "results": results,
    }
    for system, r in results.items():
        print(f"{system:<14} {r['cpu_ms_per_token']:7.2f} CPU ms/token  {r['wall_ms_per_token']:7.2f} wall ms/token")
    if args.out:
        write_report(args.out, report)


def _cmdline(d: Path) -> list[str] | None:
    try:
        return [w.decode(errors="replace") for w in (d / "cmdline").read_bytes().split(b"\0") if w] or None
    except OSError:
        return None


if __name__ == "__main__":
    main()
