"""A synthetic Llama GGUF of a chosen shape, for measuring what loading a model bigger than the bundled one costs
(no such file is on the machine, and none can be downloaded): the bundled model's tokenizer and metadata, a Q8_0
embedding and random Q4_0 projections (codes random, scales 0.01), float32 norms.

    python -m bench.offline.make_synthetic_gguf /tmp/synthetic-1b-q4_0.gguf        # ~1.07B parameters, 656 MB
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.model.model_files import default_model_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    hidden, layers, ffn, heads, kv = args.hidden, args.layers, args.ffn, args.heads, args.kv_heads
    src = GGUFReader(default_model_path())
    w = GGUFWriter(args.out, "llama")
    override = {
        "llama.block_count": layers,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": ffn,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv,
        "llama.rope.dimension_count": hidden // heads,
        "llama.context_length": 4096,
    }
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(k, override.get(k, f.contents()), f.types[0], sub)
    vocab = int(src.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(0)

    def blocks(rows: int, cols: int, kind: Q = Q.Q4_0) -> np.ndarray:
        per = 34 if kind == Q.Q8_0 else 18  # bytes a block of 32: a float16 scale, then the codes
        data = rng.integers(0, 256, (rows, cols // 32, per), dtype=np.uint8)
        data[:, :, 0:2] = np.full((rows, cols // 32), 0.01, np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
        return data.reshape(rows, -1)

    w.add_tensor("token_embd.weight", blocks(vocab, hidden, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in [
            ("attn_q", hidden, hidden),
            ("attn_k", kv * head_dim, hidden),
            ("attn_v", kv * head_dim, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ]:
            w.add_tensor(p + name + ".weight", blocks(rows, cols), raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
