"""tests/test_fidelity.py's budget with the int16 block matmul's activations rounded more coarsely: would 8-bit
activations (llama.cpp's Q8_0, d = max|x| / 127 per 32 inputs, or Q8_K, per 256) keep the served defaults' greedy
tokens equal to float32's, alone and in a batch of 32, but where float32's top two are within MARGIN_BOUND?

Emulated, not built: every Int16BlockLinear's input is fake-quantized in float32 (q = round-to-nearest-even(x / d),
clamped to the code range, then q * d) before the real op, which then rounds it to int16 as always (a further error
of at most 2^-16 of the block's largest input, 1/258 of an 8-bit step). The weights, their sums and every other layer
stay today's. Variants: `int16` (the op's own rounding redone first: a control, it must give today's tokens), `q8_0`
(8 bits per 32), `q8_k` (8 bits per 256 where the width allows, else per 32), `q8_0_head16` (8 bits per 32 but the
LM head as today), and `q8_0_qkv` / `q8_0_o` / `q8_0_gate_up` / `q8_0_down` (8 bits per 32 into one kind of projection
only, the rest as today: which layers would tolerate int8).

    .venv/bin/python -m bench.offline.activation_bits_fidelity --out benchmarks/results/offline/activation_bits_fidelity.json
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import write_report

# name: (inputs per scale, largest code, whether the LM head keeps today's rounding, the only projections rounded so:
# their module names' last part, or None for all)
VARIANTS = {
    "today": None,
    "int16": (32, 32767.0, False, None),
    "q8_0": (32, 127.0, False, None),
    "q8_k": (256, 127.0, False, None),
    "q8_0_head16": (32, 127.0, True, None),
    **{f"q8_0_{kind}": (32, 127.0, True, f"{kind}_proj") for kind in ("qkv", "o", "gate_up", "down")},
}


def fake_quantize(x: torch.Tensor, block: int, max_code: float) -> torch.Tensor:
    """x [M, K] rounded to `max_code`-bounded integer codes with one scale per `block` inputs, as the op rounds (its
    reciprocal scale, nearest even), back in x's dtype. A width `block` does not divide is scaled per 32."""
    rows, cols = x.shape
    if cols % block:
        block = 32
    v = x.float().reshape(rows, cols // block, block)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, max_code / amax, torch.zeros_like(amax))
    q = torch.round((v * inv).clamp(-max_code, max_code))
    return (q * (amax / max_code)).reshape(rows, cols).to(x.dtype)


class Emulation:
    """Int16BlockLinear's input rounding, swapped for a variant while installed; each block layer marked with its
    module name (the LM head's is `lm_head`)."""

    def __init__(self):
        self.variant = None
        self.calls = {"projections": 0, "head": 0}

    def install(self) -> None:
        from engine.model import quantized
        from engine.runner import local_executor

        original_matmul = quantized.Int16BlockLinear._matmul
        original_swap = local_executor.use_block_weights
        emulation = self

        def matmul(layer, x, out):
            spec = VARIANTS[emulation.variant]
            name = getattr(layer, "_module_name", "")
            head = name == "lm_head"
            emulation.calls["head" if head else "projections"] += 1
            if spec is not None and not (head and spec[2]) and (spec[3] is None or name.endswith(f".{spec[3]}")):
                x = fake_quantize(x.contiguous(), spec[0], spec[1])
            return original_matmul(layer, x, out)

        def swap(model, blocks, **kw):
            swapped = original_swap(model, blocks, **kw)
            for name, layer in model.named_modules():
                if isinstance(layer, quantized.Int16BlockLinear):
                    layer._module_name = name
            return swapped

        quantized.Int16BlockLinear._matmul = matmul
        local_executor.use_block_weights = swap


def layer_types(llm) -> dict[str, str]:
    """The first decoder layer's and the LM head's block layers: class, input width, packed types."""
    from engine.model.quantized import BlockLinear

    model = llm.engine.executor.model
    return {
        name: f"{type(layer).__name__} K={layer.in_features} types={layer.types}"
        for name, layer in model.named_modules()
        if isinstance(layer, BlockLinear) and (name.startswith("layers.0.") or "lm_head" in name)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--threads", type=int, default=None, help="the op's sums do not depend on it (default: serving's count)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from engine import LLM
    from engine.model.loader import load_checkpoint
    from tests.test_fidelity import GREEDY, MARGIN_BOUND, PROMPT_SET, divergences, served_defaults

    emulation = Emulation()
    emulation.install()
    ckpt = load_checkpoint(args.model)
    start = time.time()
    outs = LLM(checkpoint=ckpt, dtype="float32", weights="dense").generate(PROMPT_SET, GREEDY)
    reference = [(o.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs]) for o in outs]
    print(f"float32 reference {time.time() - start:.0f} s", flush=True)
    result = {"model": args.model or "bundled", "margin_bound": MARGIN_BOUND, "variants": {}, "today_tokens_equal": {}}
    today = {}
    for name in args.variants:
        start = time.time()
        emulation.variant = name
        config = served_defaults() if args.threads is None else {**served_defaults(), "num_threads": args.threads}
        llm = LLM(checkpoint=ckpt, **config)  # a fresh engine: no prefix cached from another variant
        if "layers" not in result:
            result["layers"] = layer_types(llm)
        alone = [llm.generate([p], GREEDY)[0] for p in PROMPT_SET]
        batch = llm.generate(PROMPT_SET, GREEDY)
        row = {}
        for mode, got in (("alone", alone), ("batch", batch)):
            flips = [(i, pos, round(m, 4)) for i, pos, m in divergences(reference, got)]
            row[mode] = {
                "identical": len(PROMPT_SET) - len(flips),
                "divergences": flips,
                "above_bound": sum(m >= MARGIN_BOUND for _, _, m in flips),
            }
            if name == "today":
                today[mode] = [o.token_ids for o in got]
            elif today:
                result["today_tokens_equal"].setdefault(name, {})[mode] = sum(
                    a == o.token_ids for a, o in zip(today[mode], got)
                )
        row["within_budget"] = row["alone"]["above_bound"] == 0 and row["batch"]["above_bound"] == 0
        result["variants"][name] = row
        summary = {m: (row[m]["identical"], row[m]["above_bound"], row[m]["divergences"]) for m in ("alone", "batch")}
        print(f"{name} {time.time() - start:.0f} s: {summary}", flush=True)
        llm.close()
        result["calls"] = emulation.calls
        if args.out:  # after each variant: a run cut short keeps what it measured
            write_report(args.out, result)


if __name__ == "__main__":
    main()
