"""No import cycles among Twinkle's modules, over every member's src/.

An import inside a function counts as much as one at the top: a cycle that only a lazy import keeps
from failing at start-up still ties two modules together, and is one edit away from a circular-import
error. `from package import name` depends on the package (its __init__), `from package import
submodule` on the submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def twinkle_modules() -> dict[str, Path]:
    modules = {}
    for src in sorted(ROOT.glob("packages/*/src")) + sorted(ROOT.glob("apps/*/src")):
        for py in src.rglob("*.py"):
            parts = list(py.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = py
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, py in modules.items():
        package = name if py.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*kept, base] if base else kept)
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules] + ([base] if any(s not in modules for s in subs) else [])
            for target in targets:
                found = owner(target)
                if found and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    modules = twinkle_modules()
    assert "twinkle.model.transformers_model" in modules and "twinkle.serve.app" in modules
    assert not cycles(import_graph(modules))


def test_the_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
