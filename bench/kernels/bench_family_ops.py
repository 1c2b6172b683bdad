"""The per-family fused CPU ops against the chains they replace, in one process, alternating: a decode step of a
checkpoint with them and without (the q/k norms through the common fused norm, GeGLU through PyTorch, as before
family_ops.cpp), then each op alone at the checkpoint's widths.

    .venv/bin/python -m bench.kernels.bench_family_ops /tmp/gemma3-640 --batches 1 8 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a Hugging Face directory or .gguf of a family that uses them (Gemma 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=20, help="timed steps of each engine, alternating")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine import LLM, SamplingParams
    from engine.model import token_ops

    torch.set_num_threads(args.threads)
    config = {"model": args.model, "dtype": "bfloat16", "num_threads": args.threads, "speculative": "off"}
    config["max_num_seqs"] = max(args.batches)
    fused = LLM(**config).engine
    before = {**token_ops.FUSED_CPU, token_ops.HeadRMSNorm: lambda m: m.on_weight_of(token_ops.CpuRMSNorm)}
    del before[token_ops.GeluAndMul]
    saved, token_ops.FUSED_CPU = token_ops.FUSED_CPU, before
    try:
        unfused = LLM(**config).engine
    finally:
        token_ops.FUSED_CPU = saved
    report = {"model": args.model, "threads": args.threads, "step_ms": {}}
    vocab = fused.shape.vocab_size
    for batch in args.batches:
        times: dict[str, list[float]] = {"before": [], "after": []}
        engines = {"after": fused, "before": unfused}
        for engine in engines.values():
            prompts = [[1000 + (i * 7919 + j * 31) % (vocab - 1000) for j in range(args.context)] for i in range(batch)]
            for p in prompts:
                engine.add_request(p, SamplingParams(max_tokens=args.rounds + 8, temperature=0.0, ignore_eos=True))
            for _ in range(4):  # the prompts and a few warm steps
                engine.step()
        for _ in range(args.rounds):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - start) * 1e3)
        for engine in engines.values():
            while engine.has_unfinished():
                engine.step()
        med = {k: statistics.median(v) for k, v in times.items()}
        report["step_ms"][batch] = med
        print(f"batch {batch:>3}: before {med['before']:.2f} ms, after {med['after']:.2f} ms a step", flush=True)
    report["op_us"] = time_ops(fused, args.batches, args.rounds)
    if args.out:
        from bench.common import write_report

        write_report(args.out, report)
    return 0


def time_ops(engine, batches: list[int], rounds: int) -> dict:
    """Each op and the chain it replaces at the model's widths, alternating, medians of `rounds` x 50 calls (us)."""
    import torch

    from engine.model import token_ops

    layer, shape = engine.model.layers[0], engine.shape
    d, hq, hkv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    cache = torch.zeros(2, hkv, 8, 16, d, dtype=torch.bfloat16)
    plain_norms = [n.on_weight_of(token_ops.CpuRMSNorm) for n in (layer.q_norm, layer.k_norm)]
    out = {}
    for rows in batches:
        gate_up = torch.randn(rows, 2 * shape.intermediate_size).bfloat16()
        qkv = torch.randn(rows, (hq + 2 * hkv) * d).bfloat16()
        pos, slots = torch.arange(rows), torch.arange(rows)
        pairs = {
            "geglu": (lambda: token_ops.GeluAndMul()(gate_up), lambda: layer.act(gate_up)),
            "qk_norm_rope": (
                lambda: token_ops.Rotary.norm_rope_write_kv(
                    layer.rotary, qkv, *plain_norms, pos, cache, slots, hq, hkv
                ),
                lambda: layer.rotary.norm_rope_write_kv(qkv, layer.q_norm, layer.k_norm, pos, cache, slots, hq, hkv),
            ),
        }
        for name, fns in pairs.items():
            times = ([], [])
            for _ in range(rounds):
                for fn, acc in zip(fns, times):
                    start = time.perf_counter()
                    for _ in range(50):
                        fn()
                    acc.append((time.perf_counter() - start) / 50 * 1e6)
            before, after = (statistics.median(t) for t in times)
            out[f"{name} rows {rows}"] = {"before": before, "after": after}
            print(f"{name} at {rows} rows: before {before:.1f} us, after {after:.1f} us a call", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
