"""Decode tokens/s of Orcinus vs transformers `generate` (static padded batch) on the same weights and dtype.

Both systems run the same prompts at each batch size, interleaved and repeated; decode time is
(time for N tokens) - (time for 1 token), so prefill is excluded for both. Reports medians. Orcinus runs with
its defaults in the given dtype (on the CPU: the GGUF's own blocks); in bfloat16 also with `weights="dense"`
(bfloat16 weights, as transformers reads them). `--compare-unfused` adds Orcinus's defaults with PyTorch's RMSNorm
and SiLU-and-multiply in place of the fused C++ token ops, `--compare-batch-invariant` its defaults with
`batch_invariant=True`, each for an A/B in one run.

    .venv/bin/python -m bench.offline.bench_offline --out benchmarks/results/offline/vs_transformers.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch

from bench.common import write_report
from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint
from engine.model.model_files import default_model_path

SEED_TEXTS = [
    "The history of the printing press begins",
    "A recipe for a simple tomato soup:",
    "def quicksort(xs):",
    "Dear team, I am writing to let you know that",
    "The three laws of thermodynamics are",
    "In a distant galaxy, a small robot",
    "Photosynthesis is the process by which",
    "The best way to learn a language is",
]


def prompts_for(tokenizer, batch: int, length: int | None = None) -> list[list[int]]:
    """`batch` prompts, each of about ten tokens or of `length` (its seed text repeated)."""
    texts = [f"{SEED_TEXTS[i % len(SEED_TEXTS)]} (note {i})" for i in range(batch)]
    if length is None:
        return [tokenizer.encode(t) for t in texts]
    return [(tokenizer.encode(t) * length)[:length] for t in texts]


def time_orcinus(llm: LLM, prompts: list[list[int]], num_tokens: int) -> float:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == num_tokens for o in outs)
    return time.perf_counter() - t


def time_transformers(model, prompts: list[list[int]], num_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    assert out.shape[1] == width + num_tokens
    return time.perf_counter() - t


def unfused_llm(**kw) -> LLM:
    """An engine whose model keeps PyTorch's token-wise ops (the fused C++ ones are a build-time choice)."""
    from engine.runner import local_executor

    fuse = local_executor.can_fuse
    local_executor.can_fuse = lambda device, dtype: False
    try:
        return LLM(**kw)
    finally:
        local_executor.can_fuse = fuse


def machine() -> dict:
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    return {
        "cpu": cpu.stdout.strip(),
        "cores": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="both systems' dtype")
    ap.add_argument("--compare-unfused", action="store_true", help="also run without the fused CPU token ops")
    ap.add_argument("--compare-batch-invariant", action="store_true", help="also run with batch_invariant=True")
    ap.add_argument("--no-transformers", action="store_true", help="Orcinus's runs only (ratios to the first)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default: ~10-token prompts)")
    ap.add_argument("--out", default="benchmarks/results/offline/vs_transformers.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ckpt = load_checkpoint(None)
    # Long prompts time their prefill too (the first token's time): none may come from the cache of a run before.
    common = {
        "checkpoint": ckpt,
        "max_num_seqs": max(args.batches),
        "dtype": args.dtype,
        "prefix_caching": args.prompt_tokens is None,
    }
    llm = LLM(**common)
    path = default_model_path()
    dtype = getattr(torch, args.dtype)
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    pad_id = ckpt.tokenizer.eos_token_id

    runners = {"orcinus": lambda p, n: time_orcinus(llm, p, n)}
    if args.dtype == "bfloat16":
        dense = LLM(**common, weights="dense")
        runners["orcinus-dense"] = lambda p, n: time_orcinus(dense, p, n)
    if args.compare_unfused:
        unfused = unfused_llm(**common)
        runners["orcinus-unfused"] = lambda p, n: time_orcinus(unfused, p, n)
    if args.compare_batch_invariant:
        invariant = LLM(**common, batch_invariant=True)
        runners["orcinus-batch-invariant"] = lambda p, n: time_orcinus(invariant, p, n)
    if not args.no_transformers:
        runners["transformers"] = lambda p, n: time_transformers(hf, p, n, pad_id)
    results = {}
    for batch in args.batches:
        prompts = prompts_for(ckpt.tokenizer, batch, args.prompt_tokens)
        for run in runners.values():  # warm-up
            run(prompts, 2)
        samples = {name: [] for name in runners}
        firsts = {name: [] for name in runners}  # prefill and the first token
        for _ in range(args.repeats):
            for name, run in runners.items():  # interleaved, so drift hits both alike
                full, first = run(prompts, args.tokens), run(prompts, 1)
                samples[name].append(batch * (args.tokens - 1) / max(full - first, 1e-9))
                firsts[name].append(first)
        med = {name: statistics.median(v) for name, v in samples.items()}
        base = "orcinus" if args.no_transformers else "transformers"
        results[batch] = {"samples_tok_s": samples, "median_tok_s": med, "ratio": med["orcinus"] / med[base]}
        results[batch]["ratios"] = {name: med[name] / med[base] for name in med}
        results[batch]["first_token_s"] = {name: statistics.median(v) for name, v in firsts.items()}
        print(
            f"batch {batch:>3}: "
            + "  ".join(f"{name} {v:7.1f} tok/s" for name, v in med.items())
            + "  ratios "
            + " ".join(f"{r:.2f}x" for r in results[batch]["ratios"].values()),
            flush=True,
        )

    report = {
        "machine": machine(),
        "what": f"decode tokens/s, greedy, {args.dtype}, prefill excluded; median of interleaved repeats "
        "(first_token_s: the prefill and first token's time, median)",
        "prompt_tokens": args.prompt_tokens,
        "tokens_per_request": args.tokens,
        "results": results,
    }
    write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
