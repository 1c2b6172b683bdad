"""Pipeline stages on this machine: throughput of 1 vs N stages under the bench_serving workload.

Starts `orcinus serve --pipeline-stages K` for each K, and 1 stage with one torch thread (the
stages run one thread each), all with the same batch size, KV budget and token budget;
drives each with a closed loop at saturation (--max-concurrency clients, Orca-shaped requests), and
interleaves the servers over repeats so machine drift hits them alike. Reports median output tok/s
and req/s per stage count, and the ratio to 1 stage.

    python -m bench.serving.compare_pipeline --out benchmarks/results/scaling/pipeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict

from bench.common import serve_flags, served_all, write_report
from bench.serving.bench_serving import Workload, run, summarize
from bench.serving.compare_scheduling import LIMITS, server_log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="as `orcinus serve --model` (default: the bundled model)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--no-single-thread-baseline",
        action="store_true",
        help="skip `1 stage, --num-threads 1` (it separates pipelining from torch's threading)",
    )
    ap.add_argument("--num-prompts", type=int, default=24, help="requests per run")
    ap.add_argument("--max-concurrency", type=int, default=16, help="closed-loop clients (saturation)")
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--output-len", type=int, nargs=2, default=[1, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/scaling/pipeline.json")
    args = ap.parse_args()

    t_start = time.perf_counter()
    workload = Workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed=2)
    configs = {f"{k} stage(s)": ["--pipeline-stages", str(k)] for k in args.stages}
    if not args.no_single_thread_baseline:
        configs["1 stage, 1 thread"] = ["--pipeline-stages", "1", "--num-threads", "1"]
    servers = {k: [*flags, *serve_flags(args, *LIMITS)] for k, flags in configs.items()}
    # A log per configuration, named by its own flags: two of them run one stage, with and without threads.
    logs = {k: server_log(args, "-".join(w.lstrip("-") for w in flags)) for k, flags in configs.items()}
    with served_all(servers, logs.get, stop_timeout=30, timeout=180) as urls:
        for k, url in urls.items():  # warm-up
            asyncio.run(run(url, None, Workload(4, (16, 16), (4, 4)), float("inf"), 4, progress=False))
        runs: dict[str, list[dict]] = {k: [] for k in configs}
        for rep in range(args.repeats):
            for k, url in urls.items():
                results, duration = asyncio.run(
                    run(url, None, workload, float("inf"), args.max_concurrency, progress=False)
                )
                s = summarize(results, duration)
                runs[k].append(
                    {
                        "output_tok_s": s["output_throughput"],
                        "req_s": s["request_throughput"],
                        "p50_tpot_s": s["tpot_s"]["p50"],
                        "failed": s["failed"],
                        "duration_s": duration,
                    }
                )
                print(
                    f"repeat {rep}: {k}: {s['output_throughput']:6.1f} output tok/s "
                    f"{s['request_throughput']:.3f} req/s  failed {s['failed']}",
                    flush=True,
                )

    median = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    base = median[next(iter(configs))]
    summary = {k: {"median_output_tok_s": m, "ratio_to_first": m / base} for k, m in median.items()}
    line = ", ".join(f"{k}: {m:.1f} tok/s ({m / base:.2f}x)" for k, m in median.items())
    print(line)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, fp32 CPU)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": asdict(workload),
        "server_flags": configs,
        "runs": runs,
        "summary": summary,
        "summary_line": line,
        "elapsed_s": time.perf_counter() - t_start,
    }
    write_report(args.out, result)
    print(f"wrote {args.out} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
