"""No import cycle inside fsdp2d: each module sits above the modules it imports.

The graph is read with ``ast`` from fsdp2d/**.py, not by importing. It counts every
``import`` statement, function-level ones included: a lazy import inside a function is
how a cycle hides (it imports fine and still ties two layers together). An edge goes to
the module named; ``from pkg import sub`` goes to the submodule ``pkg.sub``, and the
implicit import of a parent package's ``__init__`` is not an edge (every submodule would
otherwise close a cycle with a package that re-exports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "fsdp2d"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """{module: the fsdp2d modules it imports anywhere in its source}."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path.name == "__init__.py", node, mods):
                    while t not in mods and "." in t:  # `import fsdp2d.x.y` names a module; an attribute's owner
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != mod:
                        graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_fsdp2d_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"import cycles (module: the cycle members it imports): {detail}"


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert len(graph) > 50
    assert "fsdp2d.fsdp1._optim" in graph["fsdp2d.fsdp1._wrapper"]  # only imported inside methods


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
