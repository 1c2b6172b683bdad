"""Builds the C++ CPU ops into the package when torch is importable where the package is built (`make install`,
`pip install --no-build-isolation .`, `pip wheel --no-build-isolation .`), so that serving never compiles them.

Each op is a torch CppExtension beside its source in engine/kernels/csrc/cpu (an editable install puts it in the
checkout), with the flags and the stamp of engine/kernels/cpu_ops.py, which loads it. In pip's isolated build
environment torch is absent: no op is built, and each is built at run time on first use. Everything else about the
package is in pyproject.toml.
"""

import importlib.util
import itertools
import json
import os
import shutil
import warnings
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CPU_OPS = ROOT / "engine" / "kernels" / "cpu_ops.py"


def load_ops():
    """engine/kernels/cpu_ops.py read alone: importing `engine` would need its dependencies, which pip installs
    only after it has built this package."""
    spec = importlib.util.spec_from_file_location("orcinus_cpu_ops", CPU_OPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op_builder(ops):
    """torch's BuildExtension, building the ops side by side, each only where no build with its stamp is at hand."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildOps(BuildExtension):
        def finalize_options(self):
            super().finalize_options()
            self.force = True  # whether an op compiles is decided by its stamp (build_extension), not by file times
            self.parallel = self.parallel or len(self.extensions)  # each op is one file: as long as the longest
            self.stamps = {}
            self.in_place = set()  # ops whose build is the one already beside the source: nothing to copy back

        def build_extensions(self):
            # The run-time build's flags exactly: none of those Python itself was built with (-g, -fwrapv, -DNDEBUG).
            for command in ("compiler_so", "compiler_so_cxx"):  # the second: C++ sources, in newer setuptools
                if hasattr(self.compiler, command):
                    exe = itertools.takewhile(lambda t: not t.startswith("-"), getattr(self.compiler, command))
                    self.compiler.set_executable(command, [*exe, "-fPIC"])
            # torch wraps the compiler in ccache per file by swapping the shared compiler's command: side by side, two
            # files would wrap each other's.
            os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
            super().build_extensions()

        def build_extension(self, ext):
            name = ext.name.rsplit(".", 1)[-1]
            target = Path(self.get_ext_fullpath(ext.name))
            stamp = ops.build_stamp(ops.CPU_SOURCES / ops.CPU_EXTENSIONS[name][0], ops.cflags(name))
            # This build folder's, or the one an editable install left beside the source (a wheel built after it).
            fresh = [so for so in (target, ops.prebuilt_path(name)) if so.is_file() and ops.read_stamp(so) == stamp]
            if ops.prebuilt_path(name) in fresh:
                self.in_place.add(ext.name)
            if fresh and fresh[0] != target:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(fresh[0], target)
            elif not fresh:
                ops.stamp_path(target).unlink(missing_ok=True)  # a build stopped midway must leave no stamp behind
                super().build_extension(ext)
            ops.stamp_path(target).write_text(json.dumps(stamp, indent=1) + "\n")
            self.stamps[ext.name] = ops.stamp_path(target)

        def copy_extensions_to_source(self):
            """An editable install: the modules into the checkout, then their stamps (none while a copy is partial).
            One already there is not rewritten: a server running from the checkout has it mapped."""
            every, self.extensions = self.extensions, [e for e in self.extensions if e.name not in self.in_place]
            try:
                stamps = [ops.stamp_path(Path(self.get_ext_fullpath(ext.name))) for ext in self.extensions]
                for stamp in stamps:
                    stamp.unlink(missing_ok=True)
                super().copy_extensions_to_source()
                for ext, stamp in zip(self.extensions, stamps):
                    shutil.copyfile(self.stamps[ext.name], stamp)
            finally:
                self.extensions = every

    return BuildOps.with_options(use_ninja=False)  # ninja would share one build file between the side-by-side builds


def ext_modules():
    """The ops and their builder where torch is importable and the sources are in place; else none."""
    if importlib.util.find_spec("torch") is None or not CPU_OPS.is_file():
        return {}
    warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch without numpy, which pip installs later
    from torch.utils.cpp_extension import CppExtension

    ops = load_ops()
    modules = [
        CppExtension(
            f"engine.kernels.csrc.cpu.{name}",
            [f"engine/kernels/csrc/cpu/{source}"],
            extra_compile_args=ops.cflags(name),
            extra_link_args=ops.LDFLAGS,
        )
        for name, (source, _) in ops.CPU_EXTENSIONS.items()
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": op_builder(ops)}}


setup(**ext_modules())
