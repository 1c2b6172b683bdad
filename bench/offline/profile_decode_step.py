"""Where a decode step goes, by kind of work (LM head, sampler, attention, projections, norms, RoPE,
activation, the rest), beside the step's weight-read floor: the bytes of weights it reads over the machine's
measured read bandwidth. Speculation off unless asked; each category timed around its modules' calls. `--clock
cpu` counts CPU time (one thread: the thread's; more: the process's, every thread's): on a shared, oversubscribed
machine the work, not the waits for a core. `--batch N` decodes N streams at once, their contexts spread evenly
from `--context` to `--context-max`.

    python -m bench.offline.profile_decode_step --model /tmp/gemma3-270m-q4_k_m.gguf --threads 1 --clock cpu \\
        --out benchmarks/results/models/profile_gemma3-270m.json
    python -m bench.offline.profile_decode_step --model /tmp/gemma3-270m-q4_k_m.gguf --threads 2 --clock cpu \\
        --batch 32 --context 128 --context-max 512 --out benchmarks/results/models/profile_batch32_gemma3-270m.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
from gguf import GGUFReader

from bench.common import write_report
from bench.offline.bench_memory_bandwidth import measure
from bench.offline.profile_iteration import phases
from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine

# A layer's leaf modules by attribute name, and the category each one's time goes to.
LAYER_PARTS = {
    "qkv_proj": "projections: attention",
    "o_proj": "projections: attention",
    "gate_up_proj": "projections: MLP",
    "down_proj": "projections: MLP",
    "act": "activation",
    **dict.fromkeys(
        (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "q_norm",
            "k_norm",
        ),
        "norms",
    ),
}


class Timers:
    """Seconds per category, summed over the calls since the last `reset`."""

    def __init__(self, clock):
        self.seconds = collections.defaultdict(float)
        self.clock = clock

    def wrap(self, owner, attr: str, category: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += self.clock() - t0

        setattr(owner, attr, timed)  # on the instance: nn.Module.__call__ reaches it through self.forward

    def reset(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), collections.defaultdict(float)
        return out


def instrument(engine, timers: Timers) -> None:
    model = engine.model
    timers.wrap(model, "embed", "embedding")
    timers.wrap(model, "final_norm", "norms")
    timers.wrap(model, "logits", "LM head")
    timers.wrap(engine.runner.attention, "forward", "attention")
    rotaries = {}
    for layer in model.layers:
        for attr, category in LAYER_PARTS.items():
            if hasattr(layer, attr):
                timers.wrap(getattr(layer, attr), "forward", category)
        rotaries[id(layer.rotary)] = layer.rotary  # shared between layers of one RoPE table
    for rotary in rotaries.values():
        timers.wrap(rotary, "rope_write_kv", "RoPE + K/V write")


def weight_bytes(path: str) -> dict[str, int]:
    """Bytes of the file's tensors a decode step reads: every layer's, the final norm and the LM head (the output
    tensor, or the tied embedding); the embedding's one row is left out."""
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    layers = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))
    lm_head = sum(int(t.n_bytes) for t in reader.tensors if t.name == head)
    return {"layers": layers, "lm_head": lm_head, "total": layers + lm_head}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (the shortest, with --batch)")
    ap.add_argument("--context-max", type=int, default=None, help="the longest prompt of a batch (default: --context)")
    ap.add_argument("--batch", type=int, default=1, help="streams decoding together")
    ap.add_argument("--speculative", default="off", help="the engine's draft source (served default: auto)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (unset: torch's default)")
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="cpu: CPU time (the thread's, or the process's)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads is None:
        ap.error("--clock cpu: pass --threads (1: the thread's CPU time; more: the process's)")
    # With more threads than one, the process's CPU time: every thread's work (and an OpenMP thread's spin).
    clock = time.perf_counter if args.clock == "wall" else time.thread_time if args.threads == 1 else time.process_time
    longest = args.context_max or args.context
    config = EngineConfig(
        model=args.model,
        max_num_seqs=args.batch,
        speculative=args.speculative,
        num_threads=args.threads,
        max_num_batched_tokens=max(2048, longest),
    )
    engine = build_engine(config)
    params = SamplingParams(max_tokens=4 * args.steps + 64, temperature=0.0, ignore_eos=True)
    contexts = [args.context + (longest - args.context) * i // max(1, args.batch - 1) for i in range(args.batch)]
    for i, n in enumerate(contexts):
        engine.add_request([1000 + (i * 131 + j * 7) % 20000 for j in range(n)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.requests.values()):
        engine.step()  # the prefills
    engine.step()
    phases(engine, 3, clock)  # warm-up
    plain = phases(engine, args.steps, clock)  # the step without the timers' own cost
    timers = Timers(clock)
    instrument(engine, timers)
    per_step = collections.defaultdict(list)
    model_ms = []
    for _ in range(args.steps):
        timers.reset()
        ph = phases(engine, 1, clock)
        for k, v in timers.reset().items():
            per_step[k].append(v * 1000)
        model_ms.append(ph["model"])
        per_step["sampler"].append(ph["sample"])
        per_step["schedule + update"].append(ph["schedule"] + ph["update"])
    split = {k: statistics.median(v) for k, v in per_step.items()}
    inside = sum(v for k, v in split.items() if k not in ("sampler", "schedule + update"))
    split["model: the rest (glue, residual adds, runner host work)"] = max(0.0, statistics.median(model_ms) - inside)
    threads = torch.get_num_threads()
    bandwidth = measure(512, threads, clock=clock)
    read = weight_bytes(args.model)
    # the best read rate the step's threads reached: a numpy sum (one thread) or a torch sum on them
    best = max(bandwidth["numpy_sum_gb_s"], bandwidth["torch_sum_gb_s"])
    step_ms = sum(plain.values())
    report = {
        "model": args.model,
        "threads": threads,
        "clock": args.clock,
        "load_average": os.getloadavg(),  # the machine is shared: what else ran, over 1, 5 and 15 minutes
        "context": args.context,
        "contexts": contexts,
        "batch": args.batch,
        "speculative": args.speculative,
        "step_ms": step_ms,
        "phases_ms": plain,
        "split_ms": dict(sorted(split.items(), key=lambda kv: -kv[1])),
        "weight_bytes": read,
        "bandwidth": bandwidth,
        "read_gb_s": best,
        "floor_ms": read["total"] / 1e9 / best * 1000,
    }
    report["step_over_floor"] = step_ms / report["floor_ms"]
    print(
        f"step {step_ms:.1f} ms, weight-read floor {report['floor_ms']:.1f} ms ({read['total'] / 1e6:.0f} MB at "
        f"{best:.1f} GB/s), {report['step_over_floor']:.1f}x the floor"
    )
    total = sum(split.values())
    for k, v in report["split_ms"].items():
        print(f"  {k:<58}{v:8.2f} ms {v / total:6.1%}")
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
