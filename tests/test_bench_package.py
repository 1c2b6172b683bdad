"""bench/ is a package: every script answers `python -m bench.<group>.<name> --help`, and no file in the repository
edits the module search path to reach another (imports name their package instead)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each script run as `python -m NAME --help` would run it, all in one process (torch is imported once, not per script).
HELP_ALL = r"""
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    results[name] = {"code": code, "usage": "usage:" in out.getvalue(), "tail": out.getvalue()[-400:]}
print(json.dumps(results))
"""


def scripts() -> list[str]:
    """The modules under bench/ that run as a script (a `__main__` guard), as dotted names."""
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "bench").rglob("*.py")
        if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.MULTILINE)
    )


def test_every_script_answers_help():
    names = scripts()
    assert "bench.serving.bench_serving" in names and "bench.offline.bench_offline" in names
    proc = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *names], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: r for name, r in results.items() if r["code"] != 0 or not r["usage"]}
    assert not failed, failed
    assert sorted(results) == names


def test_no_file_edits_the_module_search_path():
    # Tracked files, so that nothing outside the repository (a virtual environment, a build) is read.
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py", "*.sh"], cwd=ROOT, capture_output=True, check=False)
    files = (
        [ROOT / f for f in listed.stdout.decode().split("\0") if f]
        if listed.returncode == 0
        else [p for ext in ("py", "sh") for p in ROOT.rglob(f"*.{ext}") if ".venv" not in p.parts]
    )
    edit = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove)\b|\[|\+?=[^=])|\bsite\.addsitedir\(")
    found = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        if f.is_file()
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        if edit.search(line)
    ]
    assert not found, "\n".join(found)
