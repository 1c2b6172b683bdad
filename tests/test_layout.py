"""The package layout's rules: imports run one way, no cycles, the gateway stays above the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# Which engine packages each one may import (besides itself). Lower layers never import higher ones.
ALLOWED = {
    "core": set(),
    "kernels": set(),
    "attention": {"kernels"},
    "spec": set(),
    "model": {"core", "attention", "kernels"},
    "runner": {"core", "attention", "kernels", "model"},
    "parallel": {"core", "attention", "kernels", "model", "runner"},
    "ipc": {"core", "launch"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module named in an import statement of `path`, lazy imports inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


MODULES = {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}
GRAPH = {m: {i for i in imports_of(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def layer_of(module: str) -> str:
    """`engine.runner.cuda_graphs` -> "runner"; the top-level modules are their own layer (`engine.launch` -> "launch")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "engine"


def test_no_engine_module_imports_the_gateway():
    offenders = {m for m, p in MODULES.items() if any(i.split(".")[0] == "gateway" for i in imports_of(p))}
    assert not offenders


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package):
    bad = {
        (m, d) for m, deps in GRAPH.items() if layer_of(m) == package
        for d in deps if layer_of(d) not in ALLOWED[package] | {package}
    }
    assert not bad


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d):] + [d]) if d in path else d)
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_packages_stay_small_and_say_what_they_own():
    for package in sorted({p.parent for p in ENGINE.rglob("__init__.py")}):
        assert len(list(package.glob("*.py"))) - 1 <= 10, package
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), package
