"""A pytest plugin that builds every C++ CPU op for -march=haswell (AVX2, no AVX-512) and runs the tests on those
builds, so an AVX-512 machine checks the other half of each op: `pytest -p tests.avx2_build tests/test_sampling.py`."""

from engine.kernels import cpu_ops

cpu_ops.load_for("haswell")


def pytest_report_header(config):
    return "C++ CPU ops: -march=haswell builds (the AVX2 half of each op)"
