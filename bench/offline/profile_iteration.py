"""Where an iteration's time goes: decode steps at several batch sizes, split by phase and by kind of op (on a GPU:
by kernel device time, with the top kernels per step in the JSON).

    python -m bench.offline.profile_iteration --batches 1 8 32 --context 128 \\
        --out benchmarks/results/offline/iteration_profile.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import write_report
from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.launch import build_engine

GEMM = {"aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int4pack_mm_for_cpu"}
ATTENTION = {
    "aten::index",
    "aten::index_copy_",
    "aten::bmm",
    "aten::_softmax",
    "aten::masked_fill_",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
}


def decode_engine(batch: int, context: int, args) -> EngineCore:
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=batch,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=max(2048, batch * context),
        compile=args.compile,
    )
    engine = build_engine(config)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)  # outlasts the profiled steps
    for i in range(batch):
        engine.add_request([1000 + (i * 7 + j) % 20000 for j in range(context)], params)
    engine.step()  # the prefill; what follows are pure decode iterations
    return engine


def phases(engine: EngineCore, steps: int, clock=time.perf_counter) -> dict[str, float]:
    """Median ms per phase of `steps` decode iterations (the same split as EngineCore.step), by `clock` (on one
    thread, time.thread_time: the work, not the waits of a shared machine)."""
    t = {"schedule": [], "model": [], "sample": [], "update": []}
    for _ in range(steps):
        t0 = clock()
        batch = engine.scheduler.schedule()
        t1 = clock()
        logits = engine.runner.run(batch)
        t2 = clock()
        # Their sampling states were added by the prefill.
        sampled = engine.executor.sampler(logits, batch.sampling_ids, batch.sampling_drafts)
        t3 = clock()
        engine.scheduler.update(batch, sampled)
        t4 = clock()
        for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k].append(v * 1000)
    return {k: statistics.median(v) for k, v in t.items()}


def op_split(engine: EngineCore, steps: int, table: bool) -> tuple[dict[str, float], list[dict]]:
    """Share of model time in GEMMs, attention and everything else (self CPU time of ops; on a GPU, device time of
    kernels, which is where a step's time goes once graphs replay it), and on a GPU the kernels per step."""
    gpu = engine.runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        for _ in range(steps):
            engine.step()  # the whole step: a batch left in flight would keep its requests out of the next one
    if table:
        for key in ("self_cpu_time_total",) + ("self_device_time_total",) * gpu:
            print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90), flush=True)
    events = prof.key_averages()
    if gpu:  # kernels only: a graph's replay is one CPU call whatever it runs
        times = {e.key: e.self_device_time_total for e in events if e.self_device_time_total > 0}
        kind = device_kind
    else:
        times = {e.key: e.self_cpu_time_total for e in events}
        kind = lambda name: "gemm" if name in GEMM else "attention" if name in ATTENTION else "other"
    total = sum(times.values()) or 1.0
    split = {k: 0.0 for k in ("gemm", "attention", "other")}
    for name, t in times.items():
        split[kind(name)] += t / total
    calls = {e.key: e.count for e in events}
    kernels = (
        [
            {"name": name, "us_per_step": t / steps, "calls_per_step": calls[name] / steps}
            for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:40]
        ]
        if gpu
        else []
    )
    return split, kernels


def device_kind(kernel: str) -> str:
    """gemm / attention / other, by a CUDA kernel's name (cuBLAS's nvjet/cutlass/gemm; our decode kernel, flash)."""
    name = kernel.lower()
    if any(k in name for k in ("nvjet", "gemm", "cutlass", "splitkreduce", "sm90_xmma")):
        return "gemm"
    if any(k in name for k in ("paged_decode", "flash", "attention")):
        return "attention"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when there is one)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile of the token-wise ops inside the graphs (off: PyTorch's ops, for an A/B)",
    )
    ap.add_argument("--table", action="store_true", help="print the profiler's table of ops")
    ap.add_argument("--out", default="benchmarks/results/offline/iteration_profile.json")
    args = ap.parse_args()
    rows = {}
    report = {"threads": torch.get_num_threads(), "context": args.context, "rows": rows, "complete": False}
    for b in args.batches:
        engine = decode_engine(b, args.context, args)
        phases(engine, 3)  # warm-up
        ph = phases(engine, args.steps)
        split, kernels = op_split(engine, max(3, args.steps // 3), args.table)
        rows[b] = {
            "phases_ms": ph,
            "model_op_share": split,
            "step_ms": sum(ph.values()),
            "tokens_per_s": b / sum(ph.values()) * 1000,
            "kernels": kernels,
        }
        print(
            f"batch {b:>3}: step {rows[b]['step_ms']:7.1f} ms ({rows[b]['tokens_per_s']:6.1f} tok/s)  "
            + "  ".join(f"{k} {v:6.1f}" for k, v in ph.items())
            + f"  | model: gemm {split['gemm']:.0%} attention {split['attention']:.0%} other {split['other']:.0%}",
            flush=True,
        )
        write_report(args.out, report)  # each batch size as it is measured: a time limit keeps what is done
        del engine  # its KV cache holds most of a GPU's memory: the next engine needs it
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["complete"] = True
    write_report(args.out, report)


if __name__ == "__main__":
    main()
