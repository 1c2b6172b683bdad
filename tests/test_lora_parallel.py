"""LoRA adapters with everything else (float32, the tiny dummy model): 32 requests over 8 adapters and the base model
in one run give each request its tokens alone, under speculation (drafts verified under the request's adapter) and
split over 2 tensor-parallel ranks x 2 pipeline stages (each rank holding its part of each adapter); each rank's
parts of an adapter put back together are the adapter."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.core.config import DUMMY_SHAPES
from engine.core.lora_pool import AdapterError
from engine.model.lora import read_adapter
from engine.model.lora_shards import adapter_bytes, adapter_from_bytes, adapter_part, check_adapter, module_widths
from engine.model.sharding import TensorShard
from engine.parallel.stage import stage_span

TINY = "dummy:tiny"
SHAPE = DUMMY_SHAPES["tiny"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["", *(f"ad{i}" for i in range(8))]  # "" is the base model
# Repeated runs of tokens give prompt lookup something to draft from.
PROMPTS = [[1000 + 7 * j for j in range(5)] * 3, [3000 + i for i in range(11)], [500, 501, 502] * 4, [42] * 6]
JOBS = [(NAMES[i % len(NAMES)], PROMPTS[i % len(PROMPTS)]) for i in range(32)]


def write_adapter(path, seed: int, rank: int, targets: list[str]) -> None:
    """A PEFT-format adapter of random A and B (a PEFT model's names), strong enough to change greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    widths = module_widths(SHAPE)
    tensors = {}
    for layer in range(SHAPE.num_layers):
        for module in targets:
            out, fan_in = widths[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_"
            tensors[key + "A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[key + "B.weight"] = torch.randn(out, rank, generator=gen) / rank**0.5
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """--lora specs of 8 adapters: ranks 4 to 16, each on its own projections (every one on some)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = []
    for i, name in enumerate(NAMES[1:]):
        targets = ALL if i % 4 == 0 else ALL[i % 4 :: 2]
        write_adapter(root / name, seed=i + 1, rank=4 * (1 + i % 4), targets=targets)
        specs.append(f"{name}={root / name}")
    return tuple(specs)


@pytest.fixture(scope="module")
def alone(adapters):
    """Each request's tokens run alone, in one process, without speculation."""
    llm = LLM(model=TINY, dtype="float32", lora=adapters, max_loras=4, speculative="off", num_threads=1)
    return [llm.generate([prompt], GREEDY, lora=[name])[0].token_ids for name, prompt in JOBS]


def run_together(llm: LLM) -> list[list[int]]:
    """The 32 requests in one run; every adapter was put in a slot, some more than once (four slots for eight)."""
    gate, loads = llm.engine.adapters, []
    load = gate.load
    gate.load = lambda slot, name: (loads.append(name), load(slot, name))
    got = [c.token_ids for c in llm.generate([p for _, p in JOBS], GREEDY, lora=[n for n, _ in JOBS])]
    assert set(loads) == set(NAMES[1:]) and len(loads) > len(NAMES) - 1, loads
    return got


def test_the_adapters_change_the_tokens(alone):
    base = {tuple(p): alone[i] for i, (n, p) in enumerate(JOBS) if not n}
    for i, (name, prompt) in enumerate(JOBS):
        if name:
            assert alone[i] != base[tuple(prompt)], name  # applied: the test would see a request under another's


def test_32_requests_over_8_adapters_and_the_base_under_speculation_give_their_tokens_alone(adapters, alone):
    """Four slots for eight adapters: adapters swap in and out while others run; drafts are verified under each
    request's own adapter."""
    llm = LLM(
        model=TINY, dtype="float32", lora=adapters, max_loras=4, max_num_seqs=32, speculative="ngram", num_threads=1
    )
    assert run_together(llm) == alone
    assert llm.engine.scheduler.speculation.num_drafted > 0  # drafts were verified: the test saw speculation


def test_split_over_two_tensor_parallel_ranks_and_two_stages_gives_the_tokens_alone(adapters, alone):
    with LLM(
        model=TINY,
        dtype="float32",
        lora=adapters,
        max_loras=4,
        max_num_seqs=32,
        speculative="ngram",
        tensor_parallel_size=2,
        pipeline_stages=2,
    ) as llm:
        assert run_together(llm) == alone
        assert llm.engine.scheduler.speculation.num_drafted > 0


def test_each_ranks_parts_put_back_together_are_the_adapter(adapters):
    adapter = read_adapter(adapters[0].split("=")[1], SHAPE.num_layers, 16)
    spans = [stage_span(SHAPE.num_layers, s, 2) for s in range(2)]
    parts = {
        (s, r): adapter_from_bytes(adapter_bytes(adapter_part(adapter, spans[s], TensorShard(r, 2))), 4, 2.0)
        for s in range(2)
        for r in range(2)
    }
    for (layer, module), (a, b) in adapter.weights.items():
        stage = 0 if layer in spans[0] else 1
        local = layer - spans[stage].start
        halves = [parts[stage, r].weights[local, module] for r in range(2)]
        if module in ("o_proj", "down_proj"):  # row-parallel: A cut along its inputs, B whole on each rank
            assert torch.equal(torch.cat([h[0] for h in halves], dim=1), a)
            assert all(torch.equal(h[1], b) for h in halves)
        else:  # column-parallel: A whole, B cut along its outputs with the base's rows
            assert all(torch.equal(h[0], a) for h in halves)
            assert torch.equal(torch.cat([h[1] for h in halves]), b)
    for (s, _), part in parts.items():  # a stage holds its own layers' parts, numbered from its first layer
        assert sorted(part.weights) == sorted((i - spans[s].start, m) for i, m in adapter.weights if i in spans[s])


def test_the_driver_refuses_an_adapter_of_another_model(adapters):
    adapter = read_adapter(adapters[0].split("=")[1], SHAPE.num_layers, 16)
    check_adapter(adapter, SHAPE)
    wider = dataclasses.replace(SHAPE, hidden_size=96)
    with pytest.raises(
        AdapterError, match=r"down_proj of layer 0 is \(128, 256\) \(out, in\); the model.s is \(96, 256\)"
    ):
        check_adapter(adapter, wider)
