"""llama.cpp's LoRA files (`--lora NAME=file.gguf`): a GGUF written as convert_lora_to_gguf.py writes it, from a PEFT
adapter's own weights, gives that adapter's greedy tokens exactly, on a Llama GGUF base (Q/K rows interleaved in the
base and in the adapter's B), in float32 and float16 files; a GGUF that is not a LoRA adapter is refused."""

import numpy as np
import pytest
import torch

from engine import LLM
from engine.core.lora_pool import AdapterError
from tests.test_families import build, write_gguf
from tests.test_lora import ALL, GREEDY, PROMPTS, hf_greedy, make_adapter

peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def write_lora_gguf(adapter_dir, path, config, alpha: float, dtype=np.float32) -> None:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: A and B as they are (numpy's order), under
    blk.N.<tensor>.weight.lora_a/b, Llama's Q/K rows of B interleaved as in the base model's GGUF."""
    from safetensors.torch import load_file

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, t in sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")  # base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
        layer, module, half = parts[4], parts[6], parts[7][-1].lower()
        a = t.float().numpy()
        if half == "b" and module in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{half}", np.ascontiguousarray(a, dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rounded_copy(adapter_dir, out_dir) -> None:
    """The PEFT adapter with its weights rounded to float16: what a float16 GGUF of it holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter_dir, out_dir)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({k: t.half().float() for k, t in tensors.items()}, str(out_dir / "adapter_model.safetensors"))


def test_a_llama_cpp_lora_gguf_gives_the_peft_adapters_tokens(tmp_path):
    hf = build("llama", tmp_path / "hf")
    write_gguf(hf, "llama", tmp_path / "base.gguf")
    ref = make_adapter(tmp_path / "hf", tmp_path / "peft", "llama", 8, 16, ALL, False, seed=3)
    write_lora_gguf(tmp_path / "peft", tmp_path / "lora.gguf", hf.config, 16.0)
    rounded_copy(tmp_path / "peft", tmp_path / "peft16")
    write_lora_gguf(tmp_path / "peft", tmp_path / "lora16.gguf", hf.config, 16.0, np.float16)
    specs = {
        "peft": tmp_path / "peft",
        "gguf": tmp_path / "lora.gguf",
        "peft16": tmp_path / "peft16",
        "gguf16": tmp_path / "lora16.gguf",
    }
    llm = LLM(str(tmp_path / "base.gguf"), dtype="float32", lora=tuple(f"{n}={p}" for n, p in specs.items()))

    def tokens(name: str) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(PROMPTS, GREEDY, lora=[name] * len(PROMPTS))]

    want = tokens("peft")
    assert want == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    assert want != tokens("")  # the adapter changes the answers
    assert tokens("gguf") == want
    assert tokens("gguf16") == tokens("peft16")

    with pytest.raises(AdapterError, match=r"is not a LoRA adapter GGUF \(general.type None, adapter.type None"):
        llm.engine.load_lora("base", str(tmp_path / "base.gguf"))


def test_a_lora_gguf_of_mixed_ranks_or_too_high_a_rank_is_refused(tmp_path):
    from engine.model.lora import read_adapter

    def write(path, tensors: dict[str, np.ndarray]) -> str:
        w = gguf.GGUFWriter(str(path), "qwen2")
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
        for name, t in tensors.items():
            w.add_tensor(name, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(path)

    z = np.zeros
    mixed = write(
        tmp_path / "mixed.gguf",
        {
            "blk.0.attn_q.weight.lora_a": z((4, 64), np.float32),
            "blk.0.attn_q.weight.lora_b": z((64, 4), np.float32),
            "blk.0.attn_v.weight.lora_a": z((8, 64), np.float32),
            "blk.0.attn_v.weight.lora_b": z((32, 8), np.float32),
        },
    )
    with pytest.raises(AdapterError, match=r"has ranks \[4, 8\]: one rank for every projection is served"):
        read_adapter(mixed, 2, 16)
    wide = write(
        tmp_path / "wide.gguf",
        {"blk.0.attn_q.weight.lora_a": z((32, 64), np.float32), "blk.0.attn_q.weight.lora_b": z((64, 32), np.float32)},
    )
    with pytest.raises(AdapterError, match="has rank 32; this server takes ranks up to 16"):
        read_adapter(wide, 2, 16)
    adapter = read_adapter(wide, 2, 32)  # a Qwen2 adapter: no head counts needed
    assert adapter.rank == 32 and adapter.scale == 8.0 / 32
    assert adapter.weights[0, "q_proj"][0].shape == (32, 64) and adapter.weights[0, "q_proj"][1].shape == (64, 32)
    torch.testing.assert_close(adapter.weights[0, "q_proj"][0], torch.zeros(32, 64))
