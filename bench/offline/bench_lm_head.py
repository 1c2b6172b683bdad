"""The LM head and the sampler at large vocabularies, alone: the head's matmul in each weight format the loader runs it
in (int16 activations over Q8_0 / Q4_0 blocks, the float32 block path over Q6_K, bfloat16 dense), and each phase of
the sampler (greedy's max, temperature, top-k / top-p, min-p, penalties, logprobs, the draw) over one shape's
logits. Medians; with --against a tree's sampler (its engine/model/sampling/sampler.py) the two alternate call by call.

    .venv/bin/python -m bench.offline.bench_lm_head --threads 2 --rows 1 8 32 \\
        --out benchmarks/results/kernels/lm_head_sampler.json
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from bench.common import write_report

# (vocab, hidden): Gemma 3 270M, Qwen2.5 0.5B, Llama 3.2 1B.
HEADS = [(262144, 640), (151936, 896), (128256, 2048)]
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "t0.7": {"temperature": 0.7},
    "t0.7_top_p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t0.7_top_k40": {"temperature": 0.7, "top_k": 40},
    "t0.7_top_k40_top_p0.9_min_p0.05": {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    "t0.7_min_p0.05": {"temperature": 0.7, "min_p": 0.05},
    "t0.7_penalties": {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.3},
    "greedy_logprobs5": {"temperature": 0.0, "logprobs": 5},
}


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 4)


def interleaved(fs: dict, calls: int) -> dict[str, float]:
    """Median ms of each f, the fs called in turn each round (so all see the same machine), after two warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in fs}
    for round_ in range(calls + 2):
        for name, f in fs.items():
            start = time.perf_counter()
            f()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: median_ms(t) for name, t in times.items()}


def heads(args) -> dict:
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from torch import nn

    from engine.model.packed_linear import PackedLinear, can_pack
    from engine.model.quantized import BlockLinear, Int16BlockLinear, can_use_int16
    from tests.test_quantized import random_blocks

    out = {}
    for vocab, hidden in HEADS:
        layers = {}
        for t in args.types:
            if hidden % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]:
                continue  # llama.cpp stores such a head in a fallback type (Q8_0 for Q6_K)
            blocks = random_blocks(GGMLQuantizationType[t], vocab, hidden, seed=vocab)
            int16 = t in ("Q8_0", "Q4_0", "Q4_1") and can_use_int16(torch.device("cpu"))
            layers[f"{t}_{'int16' if int16 else 'float32'}"] = (Int16BlockLinear if int16 else BlockLinear)([blocks])
        dense = nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
        layers["bf16_dense"] = (
            PackedLinear.from_linear(dense) if can_pack(torch.device("cpu"), torch.bfloat16) else dense
        )
        cell = {}
        for rows in args.rows:
            x = torch.randn(rows, hidden)
            fs = {
                name: (lambda layer=layer, name=name: layer(x.bfloat16() if name == "bf16_dense" else x))
                for name, layer in layers.items()
            }
            cell[rows] = interleaved(fs, args.head_calls)
            print(f"head {vocab}x{hidden} rows {rows}: {cell[rows]}", flush=True)
        out[f"{vocab}x{hidden}"] = cell
        del layers
    return out


def load_sampler(tree: str):
    """Another tree's Sampler class (its sampler module only; the rest of engine/ is this tree's)."""
    path = Path(tree) / "engine/model/sampling/sampler.py"
    spec = importlib.util.spec_from_file_location("against_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["against_sampler"] = module
    spec.loader.exec_module(module)
    return module.Sampler


def samplers(args) -> dict:
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.model.sampling.sampler import Sampler
    from engine.model.sampling.state import SamplingState

    kinds = {"new": Sampler}
    if args.against:
        kinds["old"] = load_sampler(args.against)
    out = {}
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        prompt = torch.randint(0, args.vocab, (200,), generator=torch.Generator().manual_seed(1)).tolist()
        outputs = torch.randint(0, args.vocab, (100,), generator=torch.Generator().manual_seed(2)).tolist()
        cell = {}
        for name, setting in SETTINGS.items():
            if args.settings and name not in args.settings:
                continue
            fs = {}
            for kind, cls in kinds.items():
                sampler = cls(seed=1)
                ids = [f"r{i}" for i in range(rows)]
                for i in ids:
                    sampler.add(SamplingState(i, prompt, SamplingParams(**setting), frozenset(), list(outputs)))
                fs[kind] = lambda sampler=sampler, ids=ids: sampler.finish(sampler.sample(logits, ids))
            cell[name] = interleaved(fs, args.calls)
            print(f"sampler {args.vocab} rows {rows} {name}: {cell[name]}", flush=True)
        out[rows] = cell
    return out


def phases(args) -> dict:
    """The torch ops the sampler is made of, one at a time, over [rows, vocab] float32 logits."""
    import torch

    from engine.model.sampling.draw import exponential_race, keys

    out = {}
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        probs = logits.softmax(-1)
        k = keys(rows, torch.Generator().manual_seed(3))
        fs = {
            "max": lambda: logits.max(dim=-1),
            "divide": lambda: logits / 0.7,
            "softmax": lambda: logits.softmax(-1),
            "log_softmax": lambda: torch.log_softmax(logits, -1),
            "sort": lambda: logits.sort(dim=-1, descending=True),
            "topk40": lambda: logits.topk(40, dim=-1),
            "topk1024": lambda: logits.topk(1024, dim=-1),
            "race": lambda: exponential_race(probs, k),
        }
        out[rows] = interleaved(fs, args.calls)
        print(f"phases {args.vocab} rows {rows}: {out[rows]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["head", "phases", "sampler"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q6_K"])
    ap.add_argument("--vocab", type=int, default=262144, help="the sampler's vocabulary")
    ap.add_argument("--settings", nargs="*", default=None, help="the sampler settings to time (default: all)")
    ap.add_argument("--against", default=None, help="a tree whose sampler is timed beside this one's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--head-calls", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "vocab": args.vocab, "rows": args.rows}
    if "head" in args.parts:
        result["head_ms"] = heads(args)
    if "phases" in args.parts:
        result["phase_ms"] = phases(args)
    if "sampler" in args.parts:
        result["sampler_ms"] = samplers(args)
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
