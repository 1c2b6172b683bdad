"""The startup block: what the engine resolved, where to reach the server."""

from engine.core.request_limits import RequestLimits
from engine.ipc.messages import EngineReady, EngineSummary
from gateway.banner import startup_block


def test_the_block_names_model_engine_capacity_and_addresses():
    ready = EngineReady(
        "m", RequestLimits(8192, 49152, 1456, 16), EngineSummary("cpu", "bfloat16", 134_515_008, 64, 512, True, 1)
    )
    text = startup_block(ready, "SmolLM2-135M-Instruct", "http://127.0.0.1:8000", api_key=True)
    assert text.splitlines() == [
        "Orcinus is ready",
        "  model           SmolLM2-135M-Instruct (134.5M parameters, max 8192 tokens)",
        "  engine          cpu, bfloat16",
        "  KV cache        1456 blocks x 16 tokens = 23,296 tokens",
        "  batch           up to 64 sequences, 512 tokens per iteration",
        "  prefix caching  on",
        "  API             http://127.0.0.1:8000/v1 (API key required)",
        "  chat page       http://127.0.0.1:8000/",
    ]


def test_pipeline_stages_and_no_caching_are_said():
    ready = EngineReady(
        "m", RequestLimits(2048, 100, 10, 16), EngineSummary("cuda", "bfloat16", 10**9, 8, 2048, False, 2)
    )
    text = startup_block(ready, "x", None, api_key=False)
    assert "  engine          cuda, bfloat16, 2 pipeline stages" in text
    assert "  prefix caching  off" in text and "chat page" not in text


def test_a_tensor_parallel_grid_is_said():
    summary = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 2, 2)
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), summary), "x", None, api_key=False)
    assert "  engine          cpu, float32, 2 pipeline stages x 2 tensor-parallel ranks" in text
    one_stage = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 1, 4)
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), one_stage), "x", None, api_key=False)
    assert "  engine          cpu, float32, 4 tensor-parallel ranks" in text


def test_the_kernels_the_executor_built_are_said_when_known():
    summary = EngineSummary(
        "cpu", "float32", 10**6, 8, 512, True, 1, 1, "C++ paged decode; BlockLinear; fused CpuRMSNorm"
    )
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), summary), "x", None, api_key=False)
    assert "  kernels         C++ paged decode; BlockLinear; fused CpuRMSNorm" in text
    unknown = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 2)
    assert "kernels" not in startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), unknown), "x", None, False)


def test_data_parallel_replicas_are_said():
    summary = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 1, 2)
    text = startup_block(
        EngineReady("m", RequestLimits(2048, 100, 10, 16), summary),
        "x",
        None,
        api_key=False,
        replicas=2,
        routing="cache-aware",
    )
    assert (
        "  engine          cpu, float32, 2 tensor-parallel ranks; 2 data-parallel replicas, cache-aware routing "
        "(each as below)"
    ) in text


def test_where_the_cpp_ops_came_from_is_said_when_any_loaded():
    summary = EngineSummary(
        "cpu",
        "float32",
        10**6,
        8,
        512,
        True,
        1,
        1,
        "C++ paged decode",
        "prebuilt in /srv/orcinus/engine/kernels/csrc/cpu",
    )
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), summary), "x", None, api_key=False)
    assert text.splitlines()[-2:] == [
        "  kernels         C++ paged decode",
        "  C++ ops         prebuilt in /srv/orcinus/engine/kernels/csrc/cpu",
    ]
    none = EngineSummary("cuda", "bfloat16", 10**6, 8, 512, True, 1, 1, "CuPy paged decode")
    assert "C++ ops" not in startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), none), "x", None, False)


def test_the_kv_cache_line_says_its_dtype_and_why():
    summary = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 1, kv_cache_dtype="float16, as asked")
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), summary), "x", None, api_key=False)
    assert "  KV cache        10 blocks x 16 tokens = 160 tokens; float16, as asked" in text.splitlines()
