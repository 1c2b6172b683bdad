"""The package layout's rules: imports run one way, no cycles, the gateway stays above the engine, and its wings
import one way too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
GATEWAY = ROOT / "gateway"

# Which engine packages each one may import (besides itself). Lower layers never import higher ones.
ALLOWED = {
    "core": set(),
    "kernels": set(),
    "attention": {"kernels"},
    "drafting": set(),
    "model": {"core", "attention", "kernels"},
    "runner": {"core", "attention", "kernels", "model"},
    "parallel": {"core", "attention", "kernels", "model", "runner"},
    "ipc": {"core", "launch"},
}

# Which gateway wings each one may import (besides itself); the modules on top (app, cli, config, banner) take any.
GATEWAY_ALLOWED = {
    "web": set(),
    "engines": {"web"},
    "api": {"web", "engines"},
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


MODULES = {module_name(p): p for root in (ENGINE, GATEWAY) for p in sorted(root.rglob("*.py"))}
GRAPH = {m: {i for i in imports_of(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def layer_of(module: str) -> str:
    """`engine.runner.cuda_graphs` -> "runner"; the top-level modules are their own layer (`engine.launch` -> "launch")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "engine"


def wing_of(module: str) -> str:
    """`gateway.api.chat` -> "api"; the modules on top (`gateway.app`, `gateway`) -> "top"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in GATEWAY_ALLOWED) else "top"


def test_no_engine_module_imports_the_gateway():
    offenders = {
        m
        for m, p in MODULES.items()
        if m.split(".")[0] == "engine" and any(i.split(".")[0] == "gateway" for i in imports_of(p))
    }
    assert not offenders


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package):
    bad = {
        (m, d)
        for m, deps in GRAPH.items()
        if m.split(".")[0] == "engine" and layer_of(m) == package
        for d in deps
        if d.split(".")[0] == "engine" and layer_of(d) not in ALLOWED[package] | {package}
    }
    assert not bad


@pytest.mark.parametrize("wing", sorted(GATEWAY_ALLOWED))
def test_gateway_wings_import_one_way(wing):
    """No wing imports the modules on top or a wing above it (api above engines above web)."""
    bad = {
        (m, d)
        for m, deps in GRAPH.items()
        if m.split(".")[0] == "gateway" and wing_of(m) == wing
        for d in deps
        if d.split(".")[0] == "gateway" and wing_of(d) not in GATEWAY_ALLOWED[wing] | {wing}
    }
    assert not bad


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d) :] + [d]) if d in path else d)
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_every_package_says_what_it_owns_and_where_it_stands():
    """A folder of modules is one concept: a package whose docstring names it, and, directly under engine/ or
    gateway/, a row in the arrows above (a new layer or wing declares what it may import)."""
    for root, allowed in ((ENGINE, ALLOWED), (GATEWAY, GATEWAY_ALLOWED)):
        for folder in sorted({p.parent for p in root.rglob("*.py")}):
            assert (folder / "__init__.py").is_file(), folder
            assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), folder
            if folder.parent == root:
                assert folder.name in allowed, folder
