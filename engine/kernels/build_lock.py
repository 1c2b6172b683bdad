"""The lock around a run-time build of a C++ op, which a stopped build cannot leave held.

torch guards each build folder with a `lock` file that it creates and removes; a builder stopped midway (SIGKILL, a
container stop, an OOM kill) leaves the file, and every later build of that op waits on it forever, silently. So an
flock of our own is taken first: the kernel drops it with its holder, and whoever holds it knows that no live Orcinus
build is in that folder, so a torch `lock` found there was left by a stopped one and goes. (A process of another
program building an op of the same name in the same folder is not seen; the folder is Orcinus's own.)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("orcinus.cpp_ops")

TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton, in each build folder
OWN_LOCK = "orcinus-build.lock"


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build folder `build_dir` alone, with no stale torch lock left in it; while another process builds
    there, wait, saying so once."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / OWN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process building the C++ ops in %s", build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        stale = build_dir / TORCH_LOCK
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
            log.warning("removed a stale build lock left by a stopped build: %s", stale)
        yield
    finally:
        os.close(fd)  # drops the flock
