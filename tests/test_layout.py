"""The package's layering, read from the source with ast: imports run core <- actors <- learner <- cli (ops beside
core), the pure core imports neither zmq nor asyncio, and actors never import learner code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "impala_async"
# What each subpackage may import from the package (besides itself).
ALLOWED = {
    "core": set(),
    "config": {"core"},
    "ops": {"core"},
    "actors": {"core", "config", "ops"},
    "learner": {"core", "config", "ops", "actors"},
}
FORBIDDEN_THIRD_PARTY = {
    "core": {"zmq", "asyncio", "uvloop"},
    "ops": {"asyncio", "uvloop", "torch"},
    "config": {"zmq", "asyncio", "uvloop", "torch", "numpy"},
}


def imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, level) for every import in ``path``, lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
            if node.level and not node.module:  # from .. import x: x may be a subpackage
                found += [(alias.name, node.level) for alias in node.names]
    return found


def target_subpackage(sub: str, module: str, level: int) -> str | None:
    """The subpackage of impala_async an import refers to (None for third-party or the same subpackage)."""
    if level == 0:
        parts = module.split(".")
        return parts[1] if parts[0] == "impala_async" and len(parts) > 1 else None
    if level == 1:
        return None  # within the same subpackage
    return module.split(".")[0] if module else None


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_imports_run_downward(sub):
    files = sorted((PKG / sub).glob("*.py"))
    assert files, sub
    for path in files:
        for module, level in imports(path):
            target = target_subpackage(sub, module, level)
            if target in ALLOWED:
                assert target in ALLOWED[sub], f"{path.relative_to(PKG)} imports {target} ({module})"
            if level == 0:
                root = module.split(".")[0]
                assert root not in FORBIDDEN_THIRD_PARTY.get(sub, set()), f"{path.relative_to(PKG)} imports {root}"


def test_every_module_is_in_a_subpackage_but_the_commands():
    """At the top: the package, its entry point, and the commands' clients of the parts below (the command line,
    and evaluation, which plays a learner's checkpoint in an actor's environment)."""
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py", "evaluate.py"]


def test_nothing_below_imports_the_commands():
    graph = import_graph()
    commands = {"impala_async.cli", "impala_async.evaluate", "impala_async.__main__"}
    for name, targets in graph.items():
        if name not in commands:
            assert not targets & commands, f"{name} imports {targets & commands}"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve_import(importer: str, is_package: bool, module: str, level: int, name: str | None) -> str | None:
    """The package module an import names (absolute), or None for third-party ones."""
    if level == 0:
        return module if module.split(".")[0] == "impala_async" else None
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    target = ".".join(base + ([module] if module else []))
    return f"{target}.{name}" if name else target


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, lazy imports inside functions included (a circle through a lazy
    import is still a circle: the two modules cannot be understood or changed one without the other)."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [resolve_import(name, is_package, a.name, 0, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve_import(name, is_package, node.module or "", node.level, None)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]  # impala_async.core.wire.encode -> impala_async.core.wire
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_anywhere_in_the_package():
    """Between subpackages and inside them, module by module (a package's __init__ re-exporting its modules counts as
    the package importing them, not the other way round)."""
    graph = import_graph()
    for name in graph:  # a module importing its own package's __init__ (for a re-export) is no circle
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and t != "impala_async")}
    assert cycles(graph) == []


def test_the_circle_finder_finds_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


MAX_FUNCTION_LINES = 60  # pyproject.toml states it beside ruff's complexity limit (max-complexity 12)


def test_no_function_of_the_package_is_longer_than_the_limit():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
