"""A plain (non-editable) `pip install .` ships the C++/CUDA sources (and the chat templates) inside the package, and
the engine looks for them there (engine/kernels/csrc/): before, it looked for the repository's top-level folder of
sources and silently fell back to the slow paths. Built where torch is importable (here: --no-build-isolation), the
wheel also carries the C++ ops, compiled, and the installed engine loads those: nothing compiles when it serves.
(setup.py copies the ops an editable install already built beside their sources, as `make install` leaves them, so this
build is quick after it.)"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import engine.kernels.cpu_ops as ops
from engine.model.tokenizer.chat_template import SHIPPED

ROOT = Path(__file__).resolve().parent.parent


def test_a_plain_install_carries_the_kernel_sources_and_the_engine_finds_them(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(wheels)],
        check=True,
        timeout=900,
        capture_output=True,
    )  # where no install built the ops yet, they compile here
    [wheel] = wheels.glob("orcinus-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300, capture_output=True
    )
    csrc = site / "engine" / "kernels" / "csrc"
    assert {p.name for p in (csrc / "cuda").iterdir()} >= {
        "paged_decode_attention.cu",
        "rope_write_kv.cu",
        "rms_norm.cu",
        "convert.cuh",
    }
    assert {p.name for p in (csrc / "cpu").iterdir()} >= {
        "paged_decode_attention.cpp",
        "token_ops.cpp",
        "block_matmul.cpp",
        "int16_matmul.cpp",
        "sampling.cpp",
        "cpu_common.h",
    }
    templates = site / "engine" / "model" / "tokenizer" / "templates"
    assert {p.name for p in templates.iterdir()} == {f"{name}.jinja" for name in SHIPPED}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for op in ops.CPU_EXTENSIONS:
        so = f"engine/kernels/csrc/cpu/{op}{sysconfig.get_config_var('EXT_SUFFIX')}"
        assert {so, f"engine/kernels/csrc/cpu/{op}.build.json"} <= names, sorted(names)
    check = (
        "import sys, pathlib\n"
        "import engine.kernels.cpu_ops as c, engine.attention.cuda_backend as cuda\n"
        "import engine.model.cuda_token_ops as rope\n"
        "assert c.CPU_SOURCES.resolve() == pathlib.Path(sys.argv[1]).resolve(), c.CPU_SOURCES\n"
        "assert cuda.KERNEL_SOURCE.is_file() and rope.KERNEL_SOURCE.is_file() and rope.NORM_SOURCE.is_file()\n"
        "assert all((c.CPU_SOURCES / f).is_file() for f, _ in c.CPU_EXTENSIONS.values())\n"
        "for op in c.CPU_EXTENSIONS: c.load_cpu_extension(op)\n"
        "assert c.ops_origin() == f'prebuilt in {c.CPU_SOURCES}', c.ops_origin()\n"
    )
    # From outside the repository, with the installed package first on the path (the venv supplies torch & co).
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", check, str(csrc / "cpu")],
        cwd=tmp_path,
        timeout=600,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
