"""A lent GPU machine can import the engine and the gateway: every third-party module they import at
module level is on the machine's image or among the wheels bench/gpu/gpu_wheels.sh carries there."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "bench" / "gpu" / "gpu_wheels.txt"  # gpu_wheels.sh fetches exactly these

# The lent GPU machine's image, as read there (the GPU desk check), with transformers' needs.
DEVICE_IMAGE = frozenset(
    {
        "torch",
        "cupy-cuda13x",
        "triton",
        "nvidia-nccl-cu13",
        "transformers",
        "tokenizers",
        "sentencepiece",
        "prometheus-client",
        "httpx",
        "uvloop",
        "numpy",
        "anyio",
        "jinja2",
        "tiktoken",
        "safetensors",
        "regex",
        "tqdm",
        "huggingface-hub",
        "pyyaml",
        "packaging",
    }
)

# Import names whose distribution is named otherwise (the rest: the import name, `_` read as `-`).
DISTRIBUTION_OF = {
    "cupy": "cupy-cuda13x",
    "yaml": "pyyaml",
    "sse_starlette": "sse-starlette",
    "prometheus_client": "prometheus-client",
    "huggingface_hub": "huggingface-hub",
}
FIRST_PARTY = {"engine", "gateway"}


def normalize(name: str) -> str:
    """PEP 503: `Prometheus_Client` and `prometheus-client` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> set[str]:
    """The distributions named in gpu_wheels.txt (a version specifier, if any, stripped)."""
    lines = (line.split("#")[0].strip() for line in WHEELS.read_text().splitlines())
    return {normalize(re.split(r"[<>=!~\[; ]", line)[0]) for line in lines if line}


def module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level package names imported when the module loads: not inside functions, not `if TYPE_CHECKING`."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def third_party_imports() -> dict[str, set[str]]:
    """{distribution: the files under engine/ and gateway/ that import it at module level}."""
    found: dict[str, set[str]] = {}
    for path in sorted([*ROOT.joinpath("engine").rglob("*.py"), *ROOT.joinpath("gateway").rglob("*.py")]):
        for name in module_level_imports(ast.parse(path.read_text())):
            if name in FIRST_PARTY or name in sys.stdlib_module_names:
                continue
            found.setdefault(normalize(DISTRIBUTION_OF.get(name, name)), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_module_level_import_reaches_the_gpu_machine():
    missing = {d: sorted(files) for d, files in third_party_imports().items() if d not in DEVICE_IMAGE | carried()}
    assert not missing, f"add these to bench/gpu/gpu_wheels.txt (and their dependencies the image lacks): {missing}"


def test_the_walk_sees_module_level_imports_only():
    tree = ast.parse(
        "import torch\nfrom llguidance import LLMatcher\nimport os.path\n"
        "try:\n    import msgspec\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    import numpy\n"
        "def f():\n    import cupy\n"
        "class C:\n    import regex\n"
    )
    assert module_level_imports(tree) == {"torch", "llguidance", "os", "msgspec", "regex"}
    # And on the real tree: the imports the GPU path needs at load time are found where they are.
    found = third_party_imports()
    assert {"engine/model/sampling/grammar.py", "gateway/api/structured.py"} <= set(found["llguidance"])
    assert "gateway/api/serving.py" in found["sse-starlette"] and "cupy-cuda13x" not in found  # CuPy loads lazily


def test_carried_wheels_do_not_shadow_the_image():
    # gpu_check.sh installs the wheels ahead of the machine's packages: a second torch or numpy would win.
    assert not carried() & DEVICE_IMAGE
    assert "bench/gpu/gpu_wheels.txt" in (ROOT / "bench" / "gpu" / "gpu_wheels.sh").read_text()
