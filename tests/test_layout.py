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


def test_every_module_is_in_a_subpackage():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py"]
