"""A synthetic GGUF of a real model's shape, for measuring models that are not on the machine (none can be
downloaded): random but well-formed blocks (finite float16 scales) in the tensor types a real file has, its
architecture's metadata, and the bundled model's byte-level BPE tokenizer padded (or cut) to the model's vocabulary.

    python -m bench.offline.make_synthetic_gguf /tmp/gemma3-270m-q4_k_m.gguf --preset gemma3-270m
    python -m bench.offline.make_synthetic_gguf /tmp/synthetic-1b-q4_0.gguf   # Llama, Q4_0 projections, 1.07B

A preset (bench/offline/synthetic_presets.py) takes the types llama.cpp's quantizer gives a Q4_K_M file; without
one the file is a Llama of --hidden/--layers/... with Q4_0 projections and a Q8_0 embedding.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from bench.offline.synthetic_presets import PRESETS, Preset, llama3_rope_factors, q4_k_m_type
from engine.model.model_files import default_model_path

# Bytes per block, and (offset, count, scale) of the float16 fields set to `scale`: values stay near N(0, 0.02).
_LAYOUT = {
    Q.Q4_0: (32, 18, [(0, 1, 0.01)]),
    Q.Q5_0: (32, 22, [(0, 1, 0.002)]),
    Q.Q8_0: (32, 34, [(0, 1, 2.5e-4)]),
    Q.Q4_K: (256, 144, [(0, 1, 1e-4), (2, 1, 7.5e-4)]),  # d, dmin; 6-bit scales and mins follow
    Q.Q6_K: (256, 210, [(208, 1, 1e-4)]),  # d last; int8 scales at 192..208 kept small below
}
Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: Q) -> np.ndarray:
    """[rows, bytes per row] of `kind` blocks: random codes, fixed finite scales."""
    per_block, size, scales = _LAYOUT[kind]
    n = cols // per_block
    data = np.frombuffer(bytearray(rng.bytes(rows * n * size)), np.uint8).reshape(rows, n, size)
    for offset, count, value in scales:
        f16 = np.full((rows, n, count), value, np.float16).view(np.uint8)
        data[:, :, offset : offset + 2 * count] = f16
    if kind == Q.Q6_K:
        data[:, :, 192:208] = rng.integers(-16, 17, (rows, n, 16), dtype=np.int8).view(np.uint8)
    return data.reshape(rows, -1)


def tokenizer_fields(src: GGUFReader, vocab: int) -> dict:
    """The bundled tokenizer's keys with `vocab` tokens: extra ones named <synthetic_N> (plain tokens no merge
    makes), or the first `vocab` with the merges that only use those."""
    fields = {}
    for k, f in src.fields.items():
        if k.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            fields[k] = (f.contents(), f.types[0], sub)
    tokens, token_types = fields["tokenizer.ggml.tokens"][0], fields["tokenizer.ggml.token_type"][0]
    if vocab >= len(tokens):
        tokens = tokens + [f"<synthetic_{i}>" for i in range(len(tokens), vocab)]
        token_types = token_types + [1] * (vocab - len(token_types))
    else:
        tokens, token_types = tokens[:vocab], token_types[:vocab]
        kept = set(tokens)
        merges = [
            m for m in fields["tokenizer.ggml.merges"][0] if all(p in kept for p in (*m.split(" "), m.replace(" ", "")))
        ]
        fields["tokenizer.ggml.merges"] = (merges, *fields["tokenizer.ggml.merges"][1:])
    fields["tokenizer.ggml.tokens"] = (tokens, *fields["tokenizer.ggml.tokens"][1:])
    fields["tokenizer.ggml.token_type"] = (token_types, *fields["tokenizer.ggml.token_type"][1:])
    return fields


def tensor_list(p: Preset, layers: int, quant: str) -> list[tuple[str, int, int, Q | None]]:
    """(name, rows, cols, type) of every tensor; type None is a float32 vector (norms, biases)."""

    def kind_type(kind: str, layer: int, cols: int) -> Q:
        if quant == "q4_0":
            return Q.Q8_0 if kind == "token_embd" else Q.Q4_0
        return q4_k_m_type(kind, layer, layers, cols, p.tied)

    h, q_size, kv_size = p.hidden, p.heads * p.head_dim, p.kv_heads * p.head_dim
    out = [("token_embd.weight", p.vocab, h, kind_type("token_embd", 0, h)), ("output_norm.weight", 1, h, None)]
    if not p.tied:
        out.append(("output.weight", p.vocab, h, kind_type("output", 0, h)))
    if p.llama3_rope:
        out.append(("rope_freqs.weight", 1, p.head_dim // 2, None))
    norms = ["attn_norm", "ffn_norm"]
    if p.gemma:
        norms += ["post_attention_norm", "post_ffw_norm"]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + n + ".weight", 1, h, None) for n in norms]
        if p.gemma:
            out += [(b + n + ".weight", 1, p.head_dim, None) for n in ("attn_q_norm", "attn_k_norm")]
        if p.qkv_bias:
            out += [
                (b + f"attn_{n}.bias", 1, size, None) for n, size in (("q", q_size), ("k", kv_size), ("v", kv_size))
            ]
        for kind, rows, cols in [
            ("attn_q", q_size, h),
            ("attn_k", kv_size, h),
            ("attn_v", kv_size, h),
            ("attn_output", h, q_size),
            ("ffn_gate", p.ffn, h),
            ("ffn_up", p.ffn, h),
            ("ffn_down", h, p.ffn),
        ]:
            out.append((b + kind + ".weight", rows, cols, kind_type(kind, i, cols)))
    return out


def write(path: str, p: Preset, layers: int, quant: str, name: str, seed: int = 0) -> None:
    src = GGUFReader(default_model_path())
    w = GGUFWriter(path, p.arch)
    w.add_name(name)
    w.add_file_type(Q4_K_M if quant == "q4_k_m" else 2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    w.add_quantization_version(2)
    for k, v in p.keys(layers).items():
        w.add_key_value(k, v, GGUFValueType.UINT32 if isinstance(v, int) else GGUFValueType.FLOAT32)
    for k, (value, kind, sub) in tokenizer_fields(src, p.vocab).items():
        w.add_key_value(k, value, kind, sub)
    rng = np.random.default_rng(seed)
    for tname, rows, cols, kind in tensor_list(p, layers, quant):
        if tname == "rope_freqs.weight":
            w.add_tensor(tname, np.array(llama3_rope_factors(p), np.float32))
        elif kind is None:  # norms as llama.cpp stores them (Gemma's 1 + w too), biases small
            values = np.zeros(cols, np.float32) if tname.endswith(".bias") else np.ones(cols, np.float32)
            w.add_tensor(tname, values)
        else:
            w.add_tensor(tname, random_blocks(rng, rows, cols, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape and Q4_K_M types")
    ap.add_argument("--layers", type=int, help="blocks (default: the preset's, or 16)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's, or the bundled model's)")
    ap.add_argument("--hidden", type=int, default=2048, help="without a preset")
    ap.add_argument("--ffn", type=int, default=8192, help="without a preset")
    ap.add_argument("--heads", type=int, default=32, help="without a preset")
    ap.add_argument("--kv-heads", type=int, default=8, help="without a preset")
    args = ap.parse_args(argv)
    if args.preset:
        p, quant = PRESETS[args.preset], "q4_k_m"
    else:
        bundled = int(GGUFReader(default_model_path()).fields["llama.vocab_size"].contents())
        hd = args.hidden // args.heads
        p = Preset("llama", bundled, args.hidden, 16, args.ffn, args.heads, args.kv_heads, hd, 4096, 100000.0, 1e-5)
        quant = "q4_0"
    if args.vocab:
        p = dataclasses.replace(p, vocab=args.vocab)
    layers = args.layers or p.layers
    write(args.out, p, layers, quant, f"synthetic {args.preset or 'llama'}")
    params = sum(rows * cols for _, rows, cols, _ in tensor_list(p, layers, quant))
    print(f"wrote {args.out}: {params / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
