"""The shape of the package, for a maintainer: files over a line limit, functions over a length limit, the most
complex functions (McCabe, as ruff's C901 counts them), and how many attributes the learner server holds.

    python tools/code_shape.py                 # this checkout
    python tools/code_shape.py --root ../old   # another checkout, to compare before and after

Attributes of the server: every distinct ``self.NAME = ...`` (or ``self.NAME: T = ...``) in the methods of
``LearnerServer`` and of the classes it inherits from within the package (mixins count: they are its attributes).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

FILE_LINES, FUNCTION_LINES = 400, 60


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def ruff_complexity(root: Path) -> list[tuple[str, int]]:
    """(function, McCabe complexity) as ruff's C901 counts it, most complex first (empty without ruff)."""
    import re
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    try:
        out = subprocess.run(
            [
                ruff,
                "check",
                "--select",
                "C901",
                "--config",
                "lint.mccabe.max-complexity=0",
                "--output-format",
                "json",
                "--exit-zero",
                "--no-cache",
                "impala_async",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    found = []
    for d in json.loads(out):
        m = re.search(r"`(.+)` is too complex \((\d+) >", d["message"])
        if m:
            found.append((f"{Path(d['filename']).relative_to(root)}:{d['location']['row']} {m[1]}", int(m[2])))
    return sorted(found, key=lambda x: -x[1])


def server_attributes(pkg: Path) -> int | None:
    classes: dict[str, ast.ClassDef] = {}
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    if "LearnerServer" not in classes:
        return None
    names, todo = set(), ["LearnerServer"]
    while todo:
        cls = classes.get(todo.pop())
        if cls is None:
            continue
        todo += [
            b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, ast.Name | ast.Attribute)
        ]
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
    return len(names)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="a checkout (default: this)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    pkg = Path(args.root) / "impala_async"
    long_files, long_fns, complex_fns, lines = [], [], [], 0
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        n = len(text.splitlines())
        lines += n
        rel = str(path.relative_to(pkg.parent))
        if n > FILE_LINES:
            long_files.append((rel, n))
        for fn in functions(ast.parse(text)):
            length = fn.end_lineno - fn.lineno + 1
            if length > FUNCTION_LINES:
                long_fns.append((f"{rel}:{fn.lineno} {fn.name}", length))
    complex_fns = ruff_complexity(Path(args.root).resolve())
    out = {
        "package_lines": lines,
        f"files_over_{FILE_LINES}_lines": long_files,
        f"functions_over_{FUNCTION_LINES}_lines": long_fns,
        "most_complex_functions": complex_fns[:8],
        "learner_server_attributes": server_attributes(pkg),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"package lines: {lines}")
    print(f"files over {FILE_LINES} lines: {len(long_files)}")
    for name, n in long_files:
        print(f"  {n:5d}  {name}")
    print(f"functions over {FUNCTION_LINES} lines: {len(long_fns)}")
    for name, n in long_fns:
        print(f"  {n:5d}  {name}")
    print("most complex functions (McCabe, ruff C901):")
    for name, n in complex_fns[:8]:
        print(f"  {n:5d}  {name}")
    print(f"LearnerServer attributes: {out['learner_server_attributes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
