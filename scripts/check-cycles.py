#!/usr/bin/env python3
"""Fail when the modules of a crate (or the files of a JavaScript or Python package) import
each other in a circle: each file should sit on top of the ones it uses, so that it can be
read, tested and changed from the bottom up (CONTRIBUTING.md, "Code").

Rust: a module's file uses another when it names `crate::a::b` (in a `use` or inline) or
`super::...`; a module never counts as using its own children or parent. Node: `require`
and `import` of a relative path. Python: `from .x import`, `from . import x`.

    python3 scripts/check-cycles.py          checks every crate and package below
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST_CRATES = ["src", "clients/rust/src", "ui/src", "tools/src", "pg_test/multi/src"]
NODE_PACKAGES = ["clients/node/src"]
PYTHON_PACKAGES = ["clients/python/src/pg_once"]


def rust_module(src: Path, file: Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def rust_graph(src: Path) -> dict:
    files = {rust_module(src, f): f for f in src.rglob("*.rs")}
    graph = {m: set() for m in files}
    for module, file in files.items():
        text = re.sub(r"//[^\n]*", "", file.read_text())
        paths = []
        for group in re.finditer(r"\bcrate::((?:\w+::)*)\{([^}]*)\}", text):
            for item in group.group(2).split(","):
                paths.append(group.group(1) + item.strip())
        paths += [m.group(1) for m in re.finditer(r"\bcrate::((?:\w+)(?:::\w+)*)", text)]
        for m in re.finditer(r"\bsuper::((?:\w+)(?:::\w+)*)", text):
            # `module` already names a mod.rs or lib.rs by its directory.
            paths.append("::".join(module[:-1] + tuple(m.group(1).split("::"))))
        for path in paths:
            parts = tuple(p for p in path.split("::") if p and p != "self")
            # The longest prefix that is a module of this crate.
            target = next((parts[:n] for n in range(len(parts), 0, -1) if parts[:n] in files), None)
            if target is None or target == module:
                continue
            if target == module[: len(target)] or module == target[: len(module)]:
                continue  # a parent or a child
            graph[module].add(target)
    return {"::".join(m) or "crate": {"::".join(t) or "crate" for t in ts} for m, ts in graph.items()}


def relative_graph(package: Path, pattern: str, suffixes: tuple) -> dict:
    files = [f for f in package.rglob("*") if f.suffix in suffixes]
    graph = {}
    for file in files:
        name = str(file.relative_to(package))
        graph[name] = set()
        for m in re.finditer(pattern, file.read_text()):
            target = (file.parent / m.group(1)).resolve()
            for candidate in [target] + [target.with_suffix(s) for s in suffixes] + \
                    [target / ("__init__" + s) for s in suffixes]:
                if candidate.is_file() and candidate != file.resolve():
                    graph[name].add(str(candidate.relative_to(package.resolve())))
                    break
    return graph


def python_graph(package: Path) -> dict:
    graph = {}
    for file in package.rglob("*.py"):
        name = str(file.relative_to(package))
        graph[name] = set()
        text = file.read_text()
        here = file.parent
        targets = []
        for m in re.finditer(r"^\s*from (\.+)([\w.]*) import ([\w, ()\n]+)", text, re.M):
            base = here
            for _ in range(len(m.group(1)) - 1):
                base = base.parent
            if m.group(2):
                targets.append(base.joinpath(*m.group(2).split(".")))
            else:
                names = re.findall(r"\w+", m.group(3))
                targets += [base / n for n in names]
        for target in targets:
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.is_file() and candidate != file:
                    # A package's __init__ importing its own modules is not a circle.
                    if file.name == "__init__.py" and candidate.parent == file.parent:
                        break
                    graph[name].add(str(candidate.relative_to(package)))
                    break
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    problems = []
    for crate in RUST_CRATES:
        for c in cycles(rust_graph(ROOT / crate)):
            problems.append(f"{crate}: {' <-> '.join(c)}")
    for package in NODE_PACKAGES:
        graph = relative_graph(ROOT / package,
                               r"(?:require\(|from\s+|import\s+)['\"](\.{1,2}/[^'\"]+)['\"]",
                               (".cjs", ".mjs", ".js"))
        for c in cycles(graph):
            problems.append(f"{package}: {' <-> '.join(c)}")
    for package in PYTHON_PACKAGES:
        for c in cycles(python_graph(ROOT / package)):
            problems.append(f"{package}: {' <-> '.join(c)}")
    for p in problems:
        print(f"modules import each other in a circle: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
