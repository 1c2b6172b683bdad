"""What a benchmark's JSON records about how it was made: the command, the commit, the machine."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def provenance() -> dict[str, str]:
    return {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "machine": subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip(),
        "cpu": cpu(),
    }


def cpu() -> str:
    """The CPU's model and widest vector set: these machines are one of several kinds, and the kernels differ."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines())}
    flags = set(fields.get("flags", "").split())
    vector = next((v for v in ("avx512_vnni", "avx512f", "avx2") if v in flags), "no avx2")
    return f"{fields.get('model name', '?')}, {vector}" + (", amx" if "amx_int8" in flags else "")
