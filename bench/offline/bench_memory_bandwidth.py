"""The machine's memory read bandwidth, the divisor of a decode step's weight-read floor: a numpy sum and copy of a
buffer far larger than the caches (one thread), and a torch sum on the threads a server uses.

    python -m bench.offline.bench_memory_bandwidth --mib 512 --threads 2 --out benchmarks/results/models/bandwidth.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import write_report


def best_seconds(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # pages touched, caches warm
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def measure(mib: int = 512, threads: int = 2, repeats: int = 7, clock=time.perf_counter) -> dict:
    """GB/s read (a sum) and read+write (a copy: counted as twice the buffer) of a `mib` MiB float32 buffer, by
    `clock` (time.thread_time with one thread: a shared machine's waits for a core left out)."""
    n = mib * 2**20 // 4
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    t = torch.from_numpy(a)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_sum = best_seconds(lambda: t.sum(), repeats, clock)
    finally:
        torch.set_num_threads(before)
    size = a.nbytes / 1e9
    return {
        "buffer_mib": mib,
        "numpy_sum_gb_s": size / best_seconds(lambda: a.sum(), repeats, clock),
        "numpy_copy_gb_s": 2 * size / best_seconds(lambda: np.copyto(b, a), repeats, clock),
        "torch_sum_gb_s": size / torch_sum,
        "torch_threads": threads,
        "clock": clock.__name__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the threaded sum")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the thread's CPU time (1 thread)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts one thread's time: pass --threads 1")
    r = measure(args.mib, args.threads, args.repeats, time.thread_time if args.clock == "cpu" else time.perf_counter)
    print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out:
        write_report(args.out, r)


if __name__ == "__main__":
    main()
