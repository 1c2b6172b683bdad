"""Builds and loads the C++ ops under cuda/*.cpp (engine/kernels/ once installed) with torch's extension builder.

They are compiled on the first use of any (together, ~40 s on two cores, then cached under
~/.cache/torch_extensions, keyed by the source) on the machine that runs them, so they may use its vector
instructions.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# In the package (a plain `pip install .` copies them there); in the repository a link to the top-level cuda/, which
# is looked at directly where a copy of the tree dropped the link (the lent GPU machine's is one).
SOURCES = next((d for d in (Path(__file__).parents[1] / "kernels", Path(__file__).resolve().parents[2] / "cuda")
                if d.is_dir()), Path(__file__).parents[1] / "kernels")
# -march=native: built where it runs. -ffast-math lets the exp and reduction loops vectorize; the ops keep
# every value finite, so nothing it assumes away occurs.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# For ops whose sums must keep the order written (no reassociation), with multiply-adds fused where they are written.
STRICT_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]


# Every C++ op on the CPU: module name -> (its source, strict: whether its sums must keep the order written).
CPU_EXTENSIONS = {
    "orcinus_cpu_block_matmul": ("block_matmul_cpu.cpp", True),
    "orcinus_cpu_int16_matmul": ("int16_matmul_cpu.cpp", True),
    "orcinus_cpu_token_ops": ("token_ops_cpu.cpp", False),
    "orcinus_cpu_attention": ("paged_decode_attention_cpu.cpp", False),
    "orcinus_cpu_sampling": ("sampling_cpu.cpp", False),
}


@functools.cache
def load_cpu_extension(name: str):
    """The extension module `name` of CPU_EXTENSIONS (once per process); raises if it cannot build."""
    return _builds()[name].result()


@functools.cache
def _builds() -> dict[str, Future]:
    """Every CPU extension's build, started together on the first use of any: each is one file that ninja compiles
    alone, so side by side they take about the longest one's time instead of the sum (a CPU engine uses them all)."""
    _put_ninja_on_path()
    pool = ThreadPoolExecutor(len(CPU_EXTENSIONS), thread_name_prefix="orcinus-cpp-build")
    builds = {name: pool.submit(_build, name, source, strict) for name, (source, strict) in CPU_EXTENSIONS.items()}
    pool.shutdown(wait=False)
    return builds


def _build(name: str, source: str, strict: bool, march: str = "native"):
    from torch.utils.cpp_extension import load

    flags = [f"-march={march}" if f == "-march=native" else f for f in (STRICT_CFLAGS if strict else CFLAGS)]
    return load(name=name, sources=[str(SOURCES / source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                verbose=False)


def load_cpu_extension_copy(name: str, source: str, march: str = "native", tag: str = "against"):
    """The extension `name` of CPU_EXTENSIONS built from another copy of its source (an older revision, for an
    A/B benchmark), under a module name of its own (`tag`), with the same flags but for -march (`haswell`: the AVX2
    build, timed on an AVX-512 machine)."""
    return _build(f"{name}_{tag}_{march.replace('-', '_')}", str(Path(source).resolve()), CPU_EXTENSIONS[name][1],
                  march)


def builds(load: Callable[[], object], unusable: str) -> bool:
    """Whether `load()` builds and loads its op (or compiles and self-tests its kernel) here; where not, a warning
    (`unusable`, then why) and False."""
    try:
        load()
    except Exception as e:  # no compiler, no ninja, a failed build or self-test: any reason is a reason to fall back
        warnings.warn(f"{unusable}: {e}", stacklevel=3)
        return False
    return True


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI wheel's binary is not there unless the venv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
