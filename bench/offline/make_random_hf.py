"""A random Hugging Face checkpoint of a family's shape (transformers' own classes, no download), for timing the
family's ops: the Gemma-3-shaped preset is narrow but has Gemma 3's head size, GeGLU width ratio and q/k norms.

    .venv/bin/python -m bench.offline.make_random_hf gemma3-640 /tmp/gemma3-640
"""

from __future__ import annotations

import argparse
import sys

PRESETS = {
    # hidden 640, 4 heads of 256 on 1 KV head, GeGLU 2048 wide, six layers (five windowed, one global)
    "gemma3-640": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "vocab_size": 32000,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "max_position_embeddings": 8192,  # room for the decode bench's 4096-token requests
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "pad_token_id": 0,
        },
    ),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    import transformers

    config_cls, model_cls, fields = PRESETS[args.preset]
    torch.manual_seed(args.seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval().to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's (1 + w) norms start at w = 0: make w matter
                p.normal_(0.0, 0.3)
    model.save_pretrained(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
