"""The synthetic GGUFs of today's model shapes: llama.cpp's Q4_K_M types per tensor, and Orcinus serves them."""

from __future__ import annotations

import math

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from bench.offline.make_synthetic_gguf import main as make_gguf
from engine import LLM, SamplingParams
from engine.model.quantized import Int16BlockLinear, _int16_ops

# Two blocks: llama.cpp's quantizer gives layer 1 of 2 (not layer 0) more bits in attn_v and ffn_down; rows that are
# not whole 256-weight blocks fall back from Q4_K to Q5_0 and from Q6_K to Q8_0.
EXPECTED = {
    "gemma3-270m": {  # hidden 640: only attn_output (1024 wide) and ffn_down (2048) take K-quants
        "token_embd": Q.Q8_0,
        "blk.0.attn_q": Q.Q5_0,
        "blk.0.attn_v": Q.Q5_0,
        "blk.1.attn_v": Q.Q8_0,
        "blk.0.attn_output": Q.Q4_K,
        "blk.0.ffn_up": Q.Q5_0,
        "blk.0.ffn_down": Q.Q4_K,
        "blk.1.ffn_down": Q.Q6_K,
    },
    "qwen2.5-0.5b": {  # hidden 896: K-quants only in ffn_down (4864 wide)
        "token_embd": Q.Q8_0,
        "blk.0.attn_q": Q.Q5_0,
        "blk.0.attn_v": Q.Q5_0,
        "blk.1.attn_v": Q.Q8_0,
        "blk.0.attn_output": Q.Q5_0,
        "blk.0.ffn_down": Q.Q4_K,
        "blk.1.ffn_down": Q.Q6_K,
        "blk.0.attn_q.bias": Q.F32,
    },
    "llama3.2-1b": {  # hidden 2048: K-quants throughout, the tied embedding Q6_K
        "token_embd": Q.Q6_K,
        "blk.0.attn_q": Q.Q4_K,
        "blk.0.attn_v": Q.Q4_K,
        "blk.1.attn_v": Q.Q6_K,
        "blk.1.ffn_gate": Q.Q4_K,
        "blk.0.ffn_down": Q.Q4_K,
        "blk.1.ffn_down": Q.Q6_K,
        "rope_freqs": Q.F32,
    },
}
ARCH = {"gemma3-270m": "gemma3", "qwen2.5-0.5b": "qwen2", "llama3.2-1b": "llama"}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_a_preset_has_q4_k_m_types_and_orcinus_generates_from_it(preset, tmp_path):
    path = str(tmp_path / f"{preset}.gguf")
    make_gguf([path, "--preset", preset, "--layers", "2", "--vocab", "1024"])
    reader = GGUFReader(path)
    types = {t.name.removesuffix(".weight"): Q(int(t.tensor_type)) for t in reader.tensors}
    assert {name: types[name] for name in EXPECTED[preset]} == EXPECTED[preset]
    assert "output" not in types  # tied, as all three are
    assert reader.fields["general.architecture"].contents() == ARCH[preset]
    llm = LLM(path, max_num_seqs=2)
    # The projections stay in the file's blocks (not dequantized): layer 1's fused Q/K/V joins three tensors' types,
    # each as the int16 op repacks it where it takes the format (Q5_0 as Q8_0's codes: the same weights).
    qkv = llm.engine.model.layers[1].qkv_proj
    stored = _int16_ops().packed_type if isinstance(qkv, Int16BlockLinear) else int
    assert qkv.types == [stored(int(types[f"blk.1.attn_{n}"])) for n in "qkv"]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 1024 for t in out.token_ids)
    assert all(math.isfinite(lp.logprob) for lp in out.logprobs)
