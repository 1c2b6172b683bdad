"""Where the C++ ops come from: the install builds them (setup.py) and the engine loads those while they match their
sources; a run-time build stopped midway leaves nothing that holds up the next one. The builds here are of a tiny
module (the Python C API alone, compiled in well under a second), never of the real ops."""

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import engine.kernels.cpu_ops as ops

ROOT = Path(__file__).resolve().parent.parent

# A module named by torch's -DTORCH_EXTENSION_NAME, as the real ops are. "held.h" lets a test hold the compiler.
DUMMY = """#include <Python.h>
#include "held.h"
#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

BUILD = """import sys
from pathlib import Path
from engine.kernels.cpu_ops import jit_load
module, _ = jit_load(sys.argv[1], [Path(sys.argv[2])], ["-O0"])
print("loaded", module.__name__)
"""


def dummy_source(folder: Path, held: bool = False) -> Path:
    """The module's source; with `held`, its header is a FIFO, so the compiler waits on it until killed."""
    if held:
        os.mkfifo(folder / "held.h")
    else:
        (folder / "held.h").write_text("\n")
    (folder / "dummy.cpp").write_text(DUMMY)
    return folder / "dummy.cpp"


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def read_until(proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    """`proc`'s stderr up to and including the line holding `text` (read unbuffered: the rest stays in the pipe)."""
    data, deadline = b"", time.monotonic() + timeout
    while text.encode() not in data or not data.endswith(b"\n"):
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no line with {text!r} in {timeout} s: {data!r}"
        chunk = os.read(proc.stderr.fileno(), 1 << 16)
        assert chunk, f"stderr closed before a line with {text!r}: {data!r}"
        data += chunk
    return data.decode()


def test_a_build_killed_midway_leaves_no_lock_that_holds_up_the_next(tmp_path):
    """The hang this guards against: torch's `lock` file, left by a build killed with SIGKILL, made every later build
    of that op wait on it forever, without a word."""
    name = "orcinus_test_stale_lock"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT)}
    build_dir, source = tmp_path / "ext" / name, dummy_source(tmp_path, held=True)
    first = subprocess.Popen(
        [sys.executable, "-c", BUILD, name, str(source)],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: (build_dir / "lock").exists() or first.poll() is not None, "the first build never began")
        assert first.poll() is None, first.communicate()
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the builder, ninja and the compiler: a container stop, an OOM kill
        first.communicate()
    assert (build_dir / "lock").exists()

    (source.parent / "held.h").unlink()
    dummy_source(tmp_path)
    # While a live process holds the build folder, the next build waits, and says what for.
    holder = os.open(build_dir / "orcinus-build.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    second = subprocess.Popen(
        [sys.executable, "-c", BUILD, name, str(source)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        waiting = read_until(second, "waiting for another process")
        assert waiting.endswith(f"waiting for another process building the C++ ops in {build_dir}\n"), waiting
        os.close(holder)  # that process gone: the stale torch lock goes, with one line, and the build completes
        out, err = (b.decode() for b in second.communicate(timeout=300))
    finally:
        second.kill()
    assert second.returncode == 0, err
    assert out == f"loaded {name}\n"
    assert f"removed a stale build lock left by a stopped build: {build_dir / 'lock'}\n" in err
    assert not (build_dir / "lock").exists()


def compile_prebuilt(folder: Path, name: str, source: Path) -> Path:
    """`source` compiled as an install would leave op `name`: beside it, with its stamp."""
    so = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            "c++",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            f"-DTORCH_EXTENSION_NAME={name}",
            str(source),
            "-o",
            str(so),
        ],
        check=True,
        timeout=120,
    )
    ops.stamp_path(so).write_text(json.dumps(ops.build_stamp(source, ["-O0"])))
    return so


def test_a_prebuilt_op_is_used_while_its_stamp_matches_and_built_at_run_time_once_its_source_changes(tmp_path, caplog):
    source = dummy_source(tmp_path)
    so = compile_prebuilt(tmp_path, "orcinus_test_prebuilt", source)
    assert ops.load_prebuilt(so, source, ["-O0"]).__name__ == "orcinus_test_prebuilt"
    assert not caplog.records

    assert ops.load_prebuilt(so, source, ["-O3"]) is None
    source.write_text(DUMMY + "// edited\n")
    assert ops.load_prebuilt(so, source, ["-O0"]) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the prebuilt C++ op {so} is out of date (its flags changed since it was built); building it at run time",
        f"the prebuilt C++ op {so} is out of date (its source changed since it was built); building it at run time",
    ]
    caplog.clear()
    ops.stamp_path(so).unlink()  # as a copy stopped midway leaves it
    assert ops.load_prebuilt(so, source, ["-O0"]) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the prebuilt C++ op {so} has no stamp of what it was built from; building it at run time"
    ]
    caplog.clear()
    assert ops.load_prebuilt(tmp_path / "absent.so", source, ["-O0"]) is None
    assert not caplog.records  # nothing was built: nothing to say


def test_a_prebuilt_op_is_out_of_date_once_a_header_beside_its_source_changes(tmp_path, caplog):
    """The sources share headers (csrc/cpu/cpu_common.h): an edited header must rebuild every op, not run it stale."""
    source = dummy_source(tmp_path)
    so = compile_prebuilt(tmp_path, "orcinus_test_header", source)
    (tmp_path / "held.h").write_text("// edited\n")
    assert ops.load_prebuilt(so, source, ["-O0"]) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the prebuilt C++ op {so} is out of date (its headers changed since it was built); building it at run time"
    ]


@pytest.mark.skipif(
    not os.environ.get("CI") and not any(ops.prebuilt_path(n).exists() for n in ops.CPU_EXTENSIONS),
    reason="this checkout's ops were not built by an install (`make install` builds them)",
)
def test_the_install_built_every_op_and_the_engine_loads_them_without_compiling():
    """What the startup block's `C++ ops` line says after `make install` (CI's case: its tests then never compile)."""
    for name in ops.CPU_EXTENSIONS:
        ops.load_cpu_extension(name)
    assert ops.ops_origin() == f"prebuilt in {ops.CPU_SOURCES}"


def test_the_origin_names_each_op_where_they_differ(monkeypatch):
    monkeypatch.setattr(
        ops,
        "_ORIGINS",
        {
            "orcinus_cpu_attention": "built at run time in /x",
            "orcinus_cpu_sampling": "prebuilt in /k",
            "orcinus_cpu_token_ops": "prebuilt in /k",
        },
    )
    assert ops.ops_origin() == "built at run time in /x (attention); prebuilt in /k (sampling, token_ops)"
    monkeypatch.setattr(ops, "_ORIGINS", {})
    assert ops.ops_origin() == ""
