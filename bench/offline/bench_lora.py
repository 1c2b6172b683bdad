"""Multi-LoRA cost: decode step time of a batch with 0, 1, 8 and 32 distinct adapters against the base model, and the
time to first token of a request whose adapter is not resident (swapped in from the host) against one whose is.

Random non-zero PEFT adapters (rank 16 by default, every projection: q/k/v/o/gate/up/down) are made with peft on the
bundled model's shape. Decode: one engine serving all of them (`--max-loras` as many, so a batch of 32 distinct ones
runs in one step) beside one without LoRA; the variants take turns, round after round, and each reports the median
of its timed steps, in wall time and in this process's CPU time (the steadier of the two where other
processes share the cores). Swap-in: an engine with `--swap-loras` adapters over `--swap-slots` slots; each round asks for the
least recently used adapter (not resident: loaded into a slot before its prompt runs), then the same adapter again
(resident), then the base model, each with a fresh prompt (no prefix-cache hit).

    python -m bench.offline.bench_lora --out benchmarks/results/offline/lora.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(root: Path, shape, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` random rank-`rank` PEFT adapters on a Llama of `shape` (no base weights needed: only the LoRA ones are
    saved), each B non-zero."""
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,  # no adapter touches the embeddings: a small table keeps the throwaway base cheap
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    model = peft.get_peft_model(base, lora).to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:  # A [r, in], B [out, r]: small, so the tokens stay the model's kind of text
                    p.copy_(torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5) * 0.5)
        paths.append(root / f"a{i}")
        model.save_pretrained(paths[-1])
    return paths


def decode_steps(engine, loras: list[str], steps: int, prompt_len: int, salt: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of `steps` pure decode steps of len(loras) requests, request i under loras[i]."""
    from engine import SamplingParams
    from engine.core.request import RequestOptions

    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)  # aborted once timed
    vocab = engine.shape.vocab_size - 1000
    reqs = [
        engine.add_request(
            [1000 + (salt * 104729 + i * 7919 + j * 31) % vocab for j in range(prompt_len)],
            params,
            RequestOptions(lora=name),
        )
        for i, name in enumerate(loras)
    ]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        engine.step()
    for _ in range(2):  # warm decode steps
        engine.step()
    times = []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        engine.step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    for r in reqs:
        engine.abort_request(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return times


def first_token(engine, lora: str, prompt_len: int, salt: int) -> tuple[float, float]:
    """(wall, CPU) seconds from adding a request under `lora` to its first token."""
    from engine import SamplingParams
    from engine.core.request import RequestOptions

    vocab = engine.shape.vocab_size - 1000
    prompt = [1000 + (salt * 104729 + j * 31) % vocab for j in range(prompt_len)]
    start, cpu = time.perf_counter(), time.process_time()
    req = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), RequestOptions(lora=lora))
    while not req.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8, 32], help="distinct adapters in the batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="turns of every variant, interleaved")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per variant per round")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="one on a shared machine: two wait on each other")
    ap.add_argument("--swap-loras", type=int, default=8, help="adapters in the swap-in run")
    ap.add_argument("--swap-slots", type=int, default=4, help="--max-loras of the swap-in run (fewer than adapters)")
    ap.add_argument("--swap-rounds", type=int, default=16)
    ap.add_argument("--swap-prompt-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine import LLM
    from engine.model.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    ckpt = load_checkpoint(None)
    count = max(max(args.adapters), args.swap_loras)
    tmp = tempfile.TemporaryDirectory(prefix="bench_lora_")
    paths = make_adapters(Path(tmp.name), ckpt.shape, count, args.rank)
    specs = tuple(f"a{i}={p}" for i, p in enumerate(paths))
    common = {"num_threads": args.threads, "max_num_seqs": args.batch, "speculative": "off"}

    # Decode: the base model alone, and under 0..N distinct adapters in one engine that holds them all resident.
    plain = LLM(checkpoint=ckpt, **common).engine
    served = LLM(
        checkpoint=ckpt,
        lora=specs[: max(args.adapters)],
        max_loras=max(args.adapters),
        max_lora_rank=args.rank,
        **common,
    ).engine
    variants = {"no-lora engine": (plain, 0)} | {f"{n} adapters": (served, n) for n in args.adapters}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for rnd in range(args.rounds):
        order = list(variants)[rnd % len(variants) :] + list(variants)[: rnd % len(variants)]  # who goes first turns
        for name in order:
            engine, n = variants[name]
            loras = [f"a{i % n}" if n else "" for i in range(args.batch)]
            times[name] += decode_steps(engine, loras, args.steps, args.prompt_len, salt=rnd * 100 + len(times[name]))
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
    decode = {}
    for name, ts in times.items():
        wall, cpu = (statistics.median(t[k] for t in ts) * 1e3 for k in (0, 1))
        decode[name] = {"median_step_ms": round(wall, 3), "median_step_cpu_ms": round(cpu, 3), "steps": len(ts)}
    for name, row in decode.items():
        base = decode["no-lora engine"]
        row["vs_base"] = round(row["median_step_ms"] / base["median_step_ms"], 3)
        row["vs_base_cpu"] = round(row["median_step_cpu_ms"] / base["median_step_cpu_ms"], 3)
        print(
            f"{name:>15}: {row['median_step_ms']:7.2f} ms a step ({row['vs_base']:.2f}x the base model),"
            f" CPU {row['median_step_cpu_ms']:7.2f} ms ({row['vs_base_cpu']:.2f}x)",
            flush=True,
        )
    del plain, served, variants

    # Swap-in: fewer slots than adapters; cycling through them in order always asks for the least recently used.
    swap = LLM(
        checkpoint=ckpt,
        lora=specs[: args.swap_loras],
        max_loras=args.swap_slots,
        max_lora_rank=args.rank,
        **common,
    ).engine
    pool = swap.adapters.pool
    ttft: dict[str, list[tuple[float, float]]] = {"not resident": [], "resident": [], "base model": []}
    load_ms = []
    executor_load = swap.executor.load_lora

    def timed_load(slot: int, name: str) -> None:
        start = time.perf_counter()
        executor_load(slot, name)
        load_ms.append((time.perf_counter() - start) * 1e3)

    swap.adapters.load = timed_load
    for rnd in range(args.swap_rounds + args.swap_slots):  # the first rounds fill the slots: not timed
        name = f"a{rnd % args.swap_loras}"
        resident = name in pool.resident
        cold = first_token(swap, name, args.swap_prompt_len, salt=10_000 + 3 * rnd)
        warm = first_token(swap, name, args.swap_prompt_len, salt=10_001 + 3 * rnd)
        base = first_token(swap, "", args.swap_prompt_len, salt=10_002 + 3 * rnd)
        if rnd >= args.swap_slots:
            assert not resident, "the adapter asked for was resident: the cycle does not evict it"
            ttft["not resident"].append(cold)
            ttft["resident"].append(warm)
            ttft["base model"].append(base)
    swapin = {name: round(statistics.median(t[0] for t in ts) * 1e3, 3) for name, ts in ttft.items()}
    swapin_cpu = {name: round(statistics.median(t[1] for t in ts) * 1e3, 3) for name, ts in ttft.items()}
    slot_load = round(statistics.median(load_ms[args.swap_slots :]), 3)
    for name, ms in swapin.items():
        print(f"TTFT {name:>12}: {ms:7.2f} ms, CPU {swapin_cpu[name]:7.2f} ms", flush=True)
    print(f"slot load (median): {slot_load:.2f} ms", flush=True)
    load_after = os.getloadavg()

    if args.out:
        from bench.common import write_report

        write_report(
            args.out,
            {
                "model": "bundled",
                "dtype": swap.config.dtype,
                "threads": args.threads,
                "batch": args.batch,
                "rank": args.rank,
                "targets": TARGETS,
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in load_after],
                "decode": decode,
                "swap_in": {
                    "adapters": args.swap_loras,
                    "max_loras": args.swap_slots,
                    "prompt_len": args.swap_prompt_len,
                    "rounds": args.swap_rounds,
                    "ttft_median_ms": swapin,
                    "ttft_median_cpu_ms": swapin_cpu,
                    "slot_load_median_ms": slot_load,
                    "ttft_ms": {name: [round(t[0] * 1e3, 3) for t in ts] for name, ts in ttft.items()},
                },
            },
        )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
