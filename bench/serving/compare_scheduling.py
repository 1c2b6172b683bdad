"""Orca's result on your machine: iteration-level vs request-level scheduling, same model and limits.

Starts Orcinus twice on loopback (`--scheduling iteration` and `request`, side by side; same max batch
size and KV budget), sweeps Poisson request rates with the bench_serving workload, both modes back to back
at each rate (so drift hits both alike), and writes the points, a plot of median normalized latency vs
throughput (like the paper's Figures 8-10) and a summary: each mode's throughput at one p50 normalized
latency, and their ratio. The JSON is rewritten after every point, so a run cut off keeps its points.

    python -m bench.serving.compare_scheduling --out benchmarks/results/scheduling/cpu.json \\
        --plot benchmarks/results/scheduling/cpu.png
    python -m bench.serving.compare_scheduling --model dummy:llama-1b --latency-target 0.008 \
        --rates 20 40 80 120 160 200 240 ...       # on a GPU: a fixed 8 ms/token (gpu_check.sh --long)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.common import scrape_metrics, serve_flags, served_all, write_report
from bench.serving.bench_serving import Workload, run, summarize

MODES = ("iteration", "request")
LIMITS = ("max_num_seqs", "kv_cache_memory", "max_num_batched_tokens", "cuda_graph_max_tokens", "model")


def server_log(args, name: str) -> Path:
    return Path(args.out).with_suffix(f".{name}.server.log")


def throughput_at(points: list[dict], latency: float) -> float:
    """Highest throughput along the curve with p50 normalized latency <= `latency` (linear between points)."""
    pts = sorted(points, key=lambda p: p["rate"])
    best = 0.0
    for a, b in zip([None] + pts, pts):
        if b["p50_normalized_latency"] <= latency:
            best = max(best, b["throughput"])
        elif a is not None and a["p50_normalized_latency"] <= latency:
            f = (latency - a["p50_normalized_latency"]) / (b["p50_normalized_latency"] - a["p50_normalized_latency"])
            best = max(best, a["throughput"] + f * (b["throughput"] - a["throughput"]))
    return best


def step_paths(url: str) -> dict[str, float]:
    """The server's forward passes since start by path (whole-step graph, piecewise graphs, eager)."""
    prefix = 'orcinus_steps_by_path{path="'
    return {
        k[len(prefix) :].split('"')[0]: v
        for k, v in scrape_metrics(url).items()
        if k.startswith(prefix) and "replica" not in k
    }


def sweep(rates: list[float], measure, points: dict[str, list[dict]], on_point=lambda mode, point: None) -> None:
    """Append measure(mode, rate) to points[mode] for both modes back to back at each rate, then on_point(mode,
    point). Which goes first alternates, so neither always runs right after the other's burst of requests."""
    for i, rate in enumerate(rates):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            points[mode].append(measure(mode, rate))
            on_point(mode, points[mode][-1])


def summarize_modes(modes: dict[str, list[dict]], latency_target: float | None) -> dict:
    """Each mode's throughput at `latency_target` (s/token; None: 2x the best p50 seen) and their ratio."""
    best = min(p["p50_normalized_latency"] for pts in modes.values() for p in pts)
    target = latency_target or 2 * best
    tput = {mode: throughput_at(pts, target) for mode, pts in modes.items()}
    # None, not infinity, where request-level never meets the target: JSON has no infinity.
    ratio = tput["iteration"] / tput["request"] if tput["request"] else None
    return {
        "latency_target_s": target,
        "target_fixed": latency_target is not None,
        "throughput_req_s": tput,
        "ratio": ratio,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode, style in (("iteration", "o-"), ("request", "s--")):
        pts = sorted(result["modes"][mode], key=lambda p: p["rate"])
        ax.plot(
            [p["throughput"] for p in pts],
            [p["p50_normalized_latency"] * 1000 for p in pts],
            style,
            label=f"{mode}-level",
        )
    slo = result["summary"]["latency_target_s"] * 1000
    ax.axhline(slo, color="gray", lw=0.8, ls=":", label=f"latency target {slo:.0f} ms/token")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_yscale("log")
    ax.set_title(f"Orcinus: iteration- vs request-level scheduling\n{result['model']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="as `orcinus serve --model` (default: the bundled model)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0, 4.0])
    ap.add_argument("--num-prompts", type=int, default=20, help="requests per rate (at least)")
    ap.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="at least this many seconds of arrivals per rate: with few requests, a run is mostly its "
        "ramp and its longest request's tail (200 at 240/s on a GPU: 0.8 s of arrivals, 2 s in all)",
    )
    # Orca's inputs are U[32, 512]; on a 2-core CPU their prefill alone caps the server near 0.3 req/s,
    # so the default sweep (sized for < 10 minutes) shortens prompts and keeps Orca's output lengths.
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--output-len", type=int, nargs=2, default=[1, 128])
    ap.add_argument("--max-num-seqs", type=int, default=16, help="max batch size, both modes")
    ap.add_argument("--kv-cache-memory", type=int, default=512 * 2**20, help="KV cache bytes, both modes")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-iteration token budget, both modes (default: the server's)",
    )
    ap.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=None,
        help="largest piecewise-graph bucket, both modes (default: the server's)",
    )
    ap.add_argument(
        "--latency-target",
        type=float,
        default=None,
        help="p50 normalized latency (s/token) at which to compare, fixed (0.008 for a GPU run); "
        "default 2x the best seen, which shrinks as the engine gets faster",
    )
    ap.add_argument("--out", default="benchmarks/results/scheduling/cpu.json")
    ap.add_argument("--plot", default="benchmarks/results/scheduling/cpu.png")
    args = ap.parse_args()

    t_start = time.perf_counter()
    workload = Workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed=1)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, the server's CPU defaults)",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "workload": asdict(workload),
        "modes": {mode: [] for mode in MODES},
        "complete": False,
    }
    servers = {mode: ["--scheduling", mode, *serve_flags(args, *LIMITS)] for mode in MODES}
    # Both up at once: the sweep alternates between them at every rate.
    with served_all(servers, lambda mode: server_log(args, mode), stop_timeout=30, timeout=180) as urls:
        for mode in MODES:
            # model=None: Orcinus serves one model and accepts requests that do not name it.
            asyncio.run(
                run(urls[mode], None, Workload(2, (16, 16), (4, 4)), float("inf"), None, progress=False)
            )  # warm-up

        def measure(mode: str, rate: float) -> dict:
            n = max(args.num_prompts, math.ceil(rate * args.seconds))
            load = workload if n == workload.num_prompts else replace(workload, num_prompts=n)
            before = step_paths(urls[mode])
            results, duration = asyncio.run(run(urls[mode], None, load, rate, None))
            after = step_paths(urls[mode])
            s = summarize(results, duration)
            if s["normalized_latency_s"]["p50"] is None:  # every request failed: no curve to draw
                sys.exit(f"{mode} rate {rate}/s: all {s['failed']} requests failed; see {server_log(args, mode)}")
            return {
                "rate": rate,
                "throughput": s["request_throughput"],
                "output_tok_s": s["output_throughput"],
                "p50_normalized_latency": s["normalized_latency_s"]["p50"],
                "p50_ttft": s["ttft_s"]["p50"],
                "failed": s["failed"],
                "duration_s": duration,
                "num_prompts": n,
                "steps_by_path": {k: v - before.get(k, 0.0) for k, v in after.items()},
            }

        def on_point(mode: str, point: dict) -> None:
            result["elapsed_s"] = time.perf_counter() - t_start
            write_report(args.out, result)
            print(
                f"{mode:>9} rate {point['rate']:6.2f}/s: {point['throughput']:.3f} req/s "
                f"{point['output_tok_s']:6.1f} tok/s  p50 norm. latency "
                f"{point['p50_normalized_latency'] * 1000:8.1f} ms/token  failed {point['failed']}  steps "
                f"{' '.join(f'{k} {v:.0f}' for k, v in sorted(point['steps_by_path'].items()))}",
                flush=True,
            )

        sweep(args.rates, measure, result["modes"], on_point)

    summary = result["summary"] = summarize_modes(result["modes"], args.latency_target)
    tput, ratio = summary["throughput_req_s"], summary["ratio"]
    result["summary_line"] = (
        f"at p50 normalized latency <= {summary['latency_target_s'] * 1000:.1f} ms/token "
        f"({'fixed' if summary['target_fixed'] else '2x the best seen'}): iteration-level {tput['iteration']:.3f} "
        f"req/s, request-level {tput['request']:.3f} req/s, ratio "
        + (f"{ratio:.2f}x" if ratio is not None else "- (request-level never meets it)")
    )
    print(result["summary_line"])
    result["elapsed_s"], result["complete"] = time.perf_counter() - t_start, True
    write_report(args.out, result)
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
