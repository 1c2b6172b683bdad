"""A plain (non-editable) `pip install .` ships the C++/CUDA sources (and the chat templates) inside the package, and
the engine looks for them there: before, it looked for the repository's cuda/ folder and silently fell back to the
slow paths. (Building the ops from the installed copy is left to the suite's other tests: a second source path would
make torch rebuild them.)"""

import os
import subprocess
import sys
from pathlib import Path

from engine.model.tokenizer.chat_template import SHIPPED

ROOT = Path(__file__).resolve().parent.parent


def test_a_plain_install_carries_the_kernel_sources_and_the_engine_finds_them(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(wheels)], check=True,
                   timeout=300, capture_output=True)
    [wheel] = wheels.glob("orcinus-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    assert {p.name for p in (site / "engine" / "kernels").iterdir()} >= {
        "paged_decode_attention.cu", "rope_write_kv.cu", "rms_norm.cu", "convert.cuh", "paged_decode_attention_cpu.cpp",
        "token_ops_cpu.cpp", "block_matmul_cpu.cpp", "int16_matmul_cpu.cpp", "sampling_cpu.cpp"}
    templates = site / "engine" / "model" / "tokenizer" / "templates"
    assert {p.name for p in templates.iterdir()} == {f"{name}.jinja" for name in SHIPPED}  # issue 60
    check = (
        "import sys, pathlib\n"
        "import engine.attention.cpp_extension as c, engine.attention.cupy_backend as cuda\n"
        "import engine.model.cuda_token_ops as rope\n"
        "assert c.SOURCES.resolve() == pathlib.Path(sys.argv[1]).resolve(), c.SOURCES\n"
        "assert cuda.KERNEL_SOURCE.is_file() and rope.KERNEL_SOURCE.is_file() and rope.NORM_SOURCE.is_file()\n"
        "assert all((c.SOURCES / f).is_file() for f, _ in c.CPU_EXTENSIONS.values())\n"
    )
    # From outside the repository, with the installed package first on the path (the venv supplies torch & co).
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", check, str(site / "engine" / "kernels")],
                          cwd=tmp_path, timeout=600, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
