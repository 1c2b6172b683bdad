"""Loads the C++ CPU ops (csrc/cpu/*.cpp): the ones an install built, else built here.

An install where torch is importable (`make install`, `pip install --no-build-isolation .`; setup.py) compiles each
beside its source, so serving never compiles. Such a prebuilt op is used only while its stamp (its source, flags,
torch and CPU) matches this checkout and machine: an edited source is built at run time rather than run stale. A
run-time build is torch's (cached under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default), under a lock
that a stopped build cannot leave held (build_lock.py). Either way they are built on the machine that runs them
(-march=native), so they may use its vector instructions.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sysconfig
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# setup.py reads this file alone, before the engine's dependencies are installed: only the standard library up here.

log = logging.getLogger("orcinus.cpp_ops")

# The sources, and the ops an install built beside them: in the checkout and in an installed package alike.
CPU_SOURCES = Path(__file__).parent / "csrc" / "cpu"
# -march=native: built where it runs. -ffast-math lets the exp and reduction loops vectorize; the ops keep
# every value finite, so nothing it assumes away occurs.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# For ops whose sums must keep the order written (no reassociation), with multiply-adds fused where they are written.
STRICT_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


# Every C++ op on the CPU: module name -> (its source, strict: whether its sums must keep the order written).
CPU_EXTENSIONS = {
    "orcinus_cpu_block_matmul": ("block_matmul.cpp", True),
    "orcinus_cpu_int16_matmul": ("int16_matmul.cpp", True),
    "orcinus_cpu_token_ops": ("token_ops.cpp", False),
    "orcinus_cpu_family_ops": ("family_ops.cpp", False),
    "orcinus_cpu_attention": ("paged_decode_attention.cpp", False),
    "orcinus_cpu_sampling": ("sampling.cpp", False),
    "orcinus_cpu_lora": ("lora_ops.cpp", True),
}

_ORIGINS: dict[str, str] = {}  # op -> where this process got it, for the startup block
_MARCH = "native"  # what every op is built for in this process (load_for)
# Read once here: sysconfig fills its variables on first use, and threads that race there may read None.
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def cflags(name: str, march: str = "native") -> list[str]:
    """The compiler flags of op `name` of CPU_EXTENSIONS, for the CPU `march`."""
    flags = STRICT_CFLAGS if CPU_EXTENSIONS[name][1] else CFLAGS
    return [f"-march={march}" if f == "-march=native" else f for f in flags]


@functools.cache
def load_cpu_extension(name: str):
    """The extension module `name` of CPU_EXTENSIONS (once per process); raises if it cannot build."""
    return _builds()[name].result()


def ops_origin() -> str:
    """Where the C++ ops this process loaded came from ("prebuilt in DIR", "built at run time in DIR", each op named
    where they differ); "" when it loaded none."""
    by_origin: dict[str, list[str]] = {}
    for name in sorted(_ORIGINS):
        by_origin.setdefault(_ORIGINS[name], []).append(name.removeprefix("orcinus_cpu_"))
    if len(by_origin) == 1:
        return next(iter(by_origin))
    return "; ".join(f"{origin} ({', '.join(names)})" for origin, names in by_origin.items())


@functools.cache
def _builds() -> dict[str, Future]:
    """Every CPU extension's load, started together on the first use of any: a run-time build compiles one file per
    op, so side by side they take about the longest one's time instead of the sum (a CPU engine uses them all)."""
    import torch  # noqa: F401 - imported here, not first by the loads side by side

    pool = ThreadPoolExecutor(len(CPU_EXTENSIONS), thread_name_prefix="orcinus-cpp-build")
    builds = {name: pool.submit(_load, name) for name in CPU_EXTENSIONS}
    pool.shutdown(wait=False)
    return builds


def load_for(march: str) -> None:
    """Build and load every op of this process for `-march` (haswell: the AVX2 half of each op, no AVX-512) instead
    of for this CPU: tests and benchmarks of another CPU's code on this one. Call it before the first op loads."""
    global _MARCH
    if _builds.cache_info().currsize:
        raise RuntimeError("load_for must come before the first C++ op loads")
    _MARCH = march


def _load(name: str):
    source = CPU_SOURCES / CPU_EXTENSIONS[name][0]
    if _MARCH != "native":
        module, build_dir = jit_load(f"{name}_{_MARCH.replace('-', '_')}", [source], cflags(name, _MARCH))
        _ORIGINS[name] = f"built for {_MARCH} in {build_dir.parent}"
        return module
    so, flags = prebuilt_path(name), cflags(name)
    module = load_prebuilt(so, source, flags)
    if module is not None:
        _ORIGINS[name] = f"prebuilt in {so.parent}"
        return module
    module, build_dir = jit_load(name, [source], flags)
    _ORIGINS[name] = f"built at run time in {build_dir.parent}"
    return module


def prebuilt_path(name: str, directory: Path = CPU_SOURCES) -> Path:
    """Where an install puts op `name`: beside its source, named as Python imports it."""
    return directory / f"{name}{EXT_SUFFIX}"


def stamp_path(so: Path) -> Path:
    """The file beside a prebuilt op that says what it was built from (`build_stamp`)."""
    return so.with_name(so.name.split(".")[0] + ".build.json")


def build_stamp(source: Path, flags: list[str]) -> dict[str, str]:
    """What a build of `source` with `flags` depends on besides the compiler: the source's bytes, the headers beside
    it (which it may include), the flags, torch (its headers and ABI) and, for -march=native, the CPU."""
    import torch

    headers = hashlib.sha256()
    for header in sorted(p for p in source.parent.glob("*.h") if p.is_file()):
        headers.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    return {
        "source": hashlib.sha256(source.read_bytes()).hexdigest(),
        "headers": headers.hexdigest(),
        "flags": " ".join(flags),
        "torch": str(torch.__version__),
        "cpu": cpu_identity(),
    }


def read_stamp(so: Path) -> dict[str, str]:
    try:
        return json.loads(stamp_path(so).read_text())
    except (OSError, ValueError):
        return {}


@functools.cache
def cpu_identity() -> str:
    """A digest of this CPU's model and instruction-set flags (what -march=native compiles for)."""
    keys = {
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "flags",
        "features",
        "cpu implementer",
        "cpu architecture",
        "cpu variant",
        "cpu part",
    }
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        block = ""
    lines = [line for line in block.splitlines() if line.split(":")[0].strip().lower() in keys]
    text = "\n".join(lines) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_prebuilt(so: Path, source: Path, flags: list[str]):
    """The module an install built in `so` from `source` with `flags`, if its stamp matches them here; else None, with
    one log line saying why (none where nothing was built)."""
    if not so.is_file():
        return None
    built, now = read_stamp(so), build_stamp(source, flags)
    changed = [key for key in now if built.get(key) != now[key]]
    if not built:
        log.warning("the prebuilt C++ op %s has no stamp of what it was built from; building it at run time", so)
        return None
    if changed:
        log.warning(
            "the prebuilt C++ op %s is out of date (its %s changed since it was built); building it at run time",
            so,
            " and ".join(changed),
        )
        return None
    spec = importlib.util.spec_from_file_location(so.name.split(".")[0], so)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        log.warning("the prebuilt C++ op %s does not load (%s); building it at run time", so, e)
        return None
    return module


def jit_load(name: str, sources: list[Path], flags: list[str]):
    """torch's run-time build of extension `name` (cached in its extensions folder) and the module, under a lock that a
    stopped build cannot leave held; returns (module, its build folder)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    from engine.kernels.build_lock import build_lock

    _put_ninja_on_path()
    build_dir = Path(_get_build_directory(name, verbose=False))
    with build_lock(build_dir):
        module = load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=flags,
            extra_ldflags=LDFLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
    return module, build_dir


def load_cpu_extension_copy(name: str, source: str, march: str = "native", tag: str = "against"):
    """The extension `name` of CPU_EXTENSIONS built from another copy of its source (an older revision, for an
    A/B benchmark), under a module name of its own (`tag`), with the same flags but for -march (`haswell`: the AVX2
    build, timed on an AVX-512 machine)."""
    module, _ = jit_load(f"{name}_{tag}_{march.replace('-', '_')}", [Path(source).resolve()], cflags(name, march))
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI wheel's binary is not there unless the venv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
