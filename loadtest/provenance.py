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
    }
