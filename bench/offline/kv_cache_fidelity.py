"""The fidelity budget of tests/test_fidelity.py for each KV cache dtype: greedy tokens of 32 prompts x 32 tokens
against the float32 model's, alone and in a batch of 32, on the bundled model (the served defaults but for
--kv-cache-dtype) and on a tiny random checkpoint of each family tests/test_families.py builds (float32, dense; the
reference there is the float32 cache). A prompt may leave the reference's tokens only where the reference's top two
logits were within MARGIN_BOUND.

    .venv/bin/python -m bench.offline.kv_cache_fidelity --out benchmarks/results/offline/kv_cache_fidelity.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import write_report

MARGIN_BOUND = 0.1
DTYPES = ["float32", "bfloat16", "float16"]
FAMILIES = ["llama 2", "qwen2 tied", "mistral (sliding window)", "phi3 (sliding window)", "gemma2", "gemma3 (text)"]


def divergences(reference, outs) -> list[tuple[int, int, float]]:
    """(prompt, position, the reference's margin there) for each prompt whose tokens leave the reference's."""
    found = []
    for i, ((want, margins), out) in enumerate(zip(reference, outs)):
        first = next((j for j, (a, b) in enumerate(zip(want, out.token_ids)) if a != b), None)
        if first is not None:
            found.append((i, first, round(margins[first], 4)))
    return found


def tokens_and_margins(outs):
    return [(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs]) for o in outs]


def measure(make, prompts, greedy, reference, dtypes) -> dict:
    """Each KV dtype's divergences from `reference`, alone and in one batch."""
    row = {}
    for kv in dtypes:
        llm = make(kv)
        alone = [llm.generate([p], greedy)[0] for p in prompts]
        batch = llm.generate(prompts, greedy)
        flips = {"alone": divergences(reference, alone), "batch": divergences(reference, batch)}
        held = all(m < MARGIN_BOUND for f in flips.values() for _, _, m in f)
        row[kv] = {**flips, "within_budget": held}
        print(f"  {kv}: alone {flips['alone']}, batch {flips['batch']}, within budget {held}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="*", default=FAMILIES)
    ap.add_argument("--no-bundled", action="store_true")
    ap.add_argument("--dtypes", nargs="+", default=DTYPES, help="KV cache dtypes to measure")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine import LLM
    from tests.test_families import CASES, build
    from tests.test_fidelity import GREEDY, PROMPT_SET, served_defaults

    result = {"margin_bound": MARGIN_BOUND, "bundled": None, "families": {}}
    if not args.no_bundled:
        print("bundled model", flush=True)
        ref = tokens_and_margins(LLM(dtype="float32", weights="dense").generate(PROMPT_SET, GREEDY))
        defaults = served_defaults()
        result["bundled"] = measure(
            lambda kv: LLM(**{**defaults, "kv_cache_dtype": kv}), PROMPT_SET, GREEDY, ref, args.dtypes
        )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, 300, (int(n),), generator=gen).tolist() for n in torch.randint(3, 120, (32,), generator=gen)
    ]
    for name in args.families:
        print(name, flush=True)
        kind, extra = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            build(kind, Path(tmp), **extra)
            make = lambda kv: LLM(str(tmp), dtype="float32", max_num_seqs=32, kv_cache_dtype=kv)
            ref = tokens_and_margins(make("float32").generate(prompts, GREEDY))
            result["families"][name] = measure(make, prompts, GREEDY, ref, args.dtypes)
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
