"""Device and dtype selection, KV cache sizing from GPU memory, and staged step inputs (all without a GPU)."""

import argparse

import pytest
import torch

from engine.core.config import DUMMY_SHAPES, EngineConfig
from engine.runner.device import (
    CPU_KV_CACHE_MEMORY,
    DeviceError,
    activation_reserve,
    gpu_kv_budget,
    kv_cache_bytes,
    num_kv_blocks,
    resolve_device,
)
from engine.runner.kv_dtype import CPU_AUTO_KV_DTYPE, KvDtypeError, describe_kv_dtype
from engine.runner.model_runner import StepInputs
from gateway.cli import add_engine_flags, engine_kwargs

GiB = 2**30


def test_auto_picks_the_gpu_in_bfloat16_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = resolve_device(EngineConfig())
    assert (config.device, config.dtype, config.max_num_batched_tokens) == ("cuda", "bfloat16", 2048)


def test_auto_falls_back_to_cpu_in_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = resolve_device(EngineConfig())
    # a smaller token budget on the CPU: every stream waits for the whole step there
    assert (config.device, config.dtype, config.max_num_batched_tokens) == ("cpu", "float32", 512)
    assert resolve_device(EngineConfig(max_num_batched_tokens=1024)).max_num_batched_tokens == 1024


def test_explicit_choices_are_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(EngineConfig(device="cuda", dtype="float16")).dtype == "float16"
    assert resolve_device(EngineConfig(device="cpu", dtype="bfloat16")).dtype == "bfloat16"
    assert resolve_device(EngineConfig(device="cuda:0")).dtype == "bfloat16"


def test_asking_for_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        resolve_device(EngineConfig(device="cuda"))


def test_unknown_dtype_is_refused():
    with pytest.raises(DeviceError, match="unknown dtype 'float8'"):
        resolve_device(EngineConfig(device="cpu", dtype="float8"))
    with pytest.raises(DeviceError):
        resolve_device(EngineConfig(device="cpu", dtype="Tensor"))  # a torch attribute, but not a dtype


def test_gpu_kv_budget_is_the_share_less_what_is_used_and_the_reserve():
    # 80 GiB card, 2 GiB already used (context + weights), 90% share, 1 GiB for activations.
    assert gpu_kv_budget(free=78 * GiB, total=80 * GiB, utilization=0.9, reserve=1 * GiB) == int(72 * GiB) - 3 * GiB


def test_gpu_kv_budget_refuses_when_nothing_is_left():
    with pytest.raises(DeviceError, match="no GPU memory left for the KV cache"):
        gpu_kv_budget(free=10 * GiB, total=80 * GiB, utilization=0.9, reserve=3 * GiB)


def test_kv_cache_bytes_on_cpu_is_the_configured_or_default_size():
    assert (
        kv_cache_bytes(EngineConfig(device="cpu", dtype="float32"), DUMMY_SHAPES["smollm2-135m"]) == CPU_KV_CACHE_MEMORY
    )
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_memory=12345)
    assert kv_cache_bytes(config, DUMMY_SHAPES["smollm2-135m"]) == 12345


def test_activation_reserve_grows_with_the_token_budget_and_covers_the_graph_pool():
    shape = DUMMY_SHAPES["llama-1b"]
    small = activation_reserve(EngineConfig(max_num_batched_tokens=512), shape, torch.bfloat16)
    large = activation_reserve(EngineConfig(max_num_batched_tokens=2048), shape, torch.bfloat16)
    eager = activation_reserve(EngineConfig(max_num_batched_tokens=2048, enforce_eager=True), shape, torch.bfloat16)
    assert small < large and eager < large
    # At 2048 tokens the gate/up output alone is 2048 x 16384 bf16 = 64 MiB; the reserve must exceed it.
    assert eager > 2048 * 2 * shape.intermediate_size * 2


def test_cli_passes_gpu_flags_through():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    args = p.parse_args(
        ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--dtype", "float16"]
    )
    assert engine_kwargs(args) == {
        "device": "cuda",
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
        "dtype": "float16",
    }
    assert engine_kwargs(p.parse_args([])) == {}


def test_step_inputs_stage_values_and_shapes():
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    inputs = StepInputs(config, max_model_len=128, device=torch.device("cpu"))
    ids = inputs.put("input_ids", [5, 6, 7])
    tables = inputs.put("block_tables", [1, 2, 3, 0], (2, 2))  # flat, shaped on the way
    assert ids.tolist() == [5, 6, 7] and ids.dtype == torch.int64
    assert tables.tolist() == [[1, 2], [3, 0]] and tables.dtype == torch.int32
    inputs.put("input_ids", [9])  # refilling the staging buffer must not change what was returned before
    assert ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, "100000"),  # ~1 ms: awake across a step's small ops, off the cores between steps
        ({"GOMP_SPINCOUNT": "5"}, "5"),  # the user's word wins
        ({"OMP_WAIT_POLICY": "PASSIVE"}, None),  # and so does a wait policy, which sets its own spin
    ],
)
def test_the_engine_process_gets_a_bounded_openmp_spin(monkeypatch, env, want):
    from gateway.engines.process import engine_env

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got = engine_env()
    assert got.get("GOMP_SPINCOUNT") == want
    assert got.get("OMP_WAIT_POLICY") == env.get("OMP_WAIT_POLICY")


def test_cli_prefix_caching_and_weights_flags():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args(["--no-prefix-caching"])) == {"prefix_caching": False}
    assert engine_kwargs(p.parse_args(["--weights", "dense", "--batch-invariant"])) == {
        "weights": "dense",
        "batch_invariant": True,
    }


def test_a_16_bit_kv_cache_holds_twice_the_blocks_in_the_same_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = DUMMY_SHAPES["smollm2-135m"]
    blocks = {
        kv: num_kv_blocks(resolve_device(EngineConfig(kv_cache_memory=64 * 737_280, kv_cache_dtype=kv)), shape, 30)
        for kv in ("float32", "bfloat16", "float16")
    }
    assert blocks == {"float32": 64, "bfloat16": 128, "float16": 128}


def test_the_kv_cache_dtype_resolves_per_device_and_compute_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(EngineConfig(device="cpu")).kv_cache_dtype == CPU_AUTO_KV_DTYPE == "float16"
    assert resolve_device(EngineConfig(device="cpu", dtype="bfloat16")).kv_cache_dtype == "bfloat16"
    assert resolve_device(EngineConfig(device="cuda")).kv_cache_dtype == "bfloat16"
    assert resolve_device(EngineConfig(device="cpu", kv_cache_dtype="float16")).kv_cache_dtype == "float16"
    assert resolve_device(EngineConfig(device="cuda", kv_cache_dtype="bfloat16")).kv_cache_dtype == "bfloat16"
    with pytest.raises(KvDtypeError, match="--kv-cache-dtype float16 runs on the CPU only"):
        resolve_device(EngineConfig(device="cuda", kv_cache_dtype="float16"))
    with pytest.raises(KvDtypeError, match="--kv-cache-dtype float16 needs --dtype float32"):
        resolve_device(EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="float16"))
    with pytest.raises(KvDtypeError, match="unknown KV cache dtype 'int8'"):
        resolve_device(EngineConfig(device="cpu", kv_cache_dtype="int8"))


def test_cli_kv_cache_dtype_flag(capsys):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "bfloat16"])) == {"kv_cache_dtype": "bfloat16"}
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8"])
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_the_startup_block_says_why_the_kv_cache_has_its_dtype():
    cpu = EngineConfig(device="cpu", dtype="float32")
    assert describe_kv_dtype("float16", resolve_device(cpu.with_(kv_cache_dtype="float16"))) == "float16, as asked"
    auto = resolve_device(cpu)
    assert describe_kv_dtype("auto", auto).startswith("float16 (auto: half float32's bytes")
    bf16 = resolve_device(EngineConfig(device="cpu", dtype="bfloat16"))
    assert describe_kv_dtype("auto", bf16) == "bfloat16, the compute dtype (auto)"
