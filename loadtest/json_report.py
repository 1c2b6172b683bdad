"""Results written as they are measured: a benchmark cut off by a time limit keeps every finished row."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | Path, data) -> None:
    """Replace `path` with `data` as JSON atomically (a temporary file beside it, then a rename): a reader,
    or an archive taken at any moment, sees the previous whole report or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
