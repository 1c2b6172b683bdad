"""A pytest plugin that builds every C++ CPU op for -march=haswell (AVX2, no AVX-512) and runs the tests on those
builds, so an AVX-512 machine checks the other half of each op: `pytest -p tests.avx2_build tests/test_sampling.py`."""

from engine.kernels import cpu_ops


def _load(name: str):
    source = cpu_ops.CPU_SOURCES / cpu_ops.CPU_EXTENSIONS[name][0]
    module, build_dir = cpu_ops.jit_load(f"{name}_haswell", [source], cpu_ops.cflags(name, "haswell"))
    cpu_ops._ORIGINS[name] = f"built for haswell in {build_dir.parent}"
    return module


cpu_ops._load = _load


def pytest_report_header(config):
    return "C++ CPU ops: -march=haswell builds (the AVX2 half of each op)"
