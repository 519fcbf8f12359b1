"""Every attribute the server reads of a serving backend is declared on `Backend`
(twinkle/serve/backend/base.py), so the contract says all that is asked of a backend and no caller
depends on what one implementation happens to have.

A backend is what a name `backend`, an attribute `.backend` (`engine.backend`) or a name annotated
`Backend` holds; a parameter annotated with a concrete backend class (`backend: MultiLoraBackend`, code
that runs inside that backend) is that class's business, not the contract's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "packages/twinkle-serve/src/twinkle/serve/backend/base.py"


def declared() -> set[str]:
    """The names class Backend declares: its methods, annotated and assigned attributes."""
    (cls,) = [n for n in ast.parse(CONTRACT.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Backend"]
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _holds_backend(expr: ast.expr, typed: dict[str, bool]) -> bool:
    if isinstance(expr, ast.Name):
        return typed.get(expr.id, expr.id == "backend")
    if isinstance(expr, ast.Attribute) and expr.attr == "backend":
        root = expr
        while isinstance(root, ast.Attribute):
            root = root.value
        return not (isinstance(root, ast.Name) and root.id == "twinkle")  # twinkle.serve.backend: the package
    return False


def backend_reads(path: Path, text: str) -> list[tuple[str, str]]:
    """(where, attribute) for every attribute read of a backend in this source."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, typed: dict[str, bool]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            typed = dict(typed)
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                note = getattr(a, "annotation", None)
                if note is not None:
                    typed[a.arg] = re.search(r"\bBackend\b", ast.unparse(note)) is not None
                else:
                    typed.pop(a.arg, None)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _holds_backend(node.value, typed):
            found.append((f"{path.relative_to(ROOT) if path.is_absolute() else path}:{node.lineno}", node.attr))
        for child in ast.iter_child_nodes(node):
            visit(child, typed)

    visit(ast.parse(text, str(path)), {})
    return found


def sources() -> list[Path]:
    return sorted([*ROOT.glob("packages/twinkle-serve/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")])


def test_every_attribute_read_of_a_backend_is_declared_on_the_contract():
    names = declared()
    reads = [r for path in sources() for r in backend_reads(path, path.read_text())]
    assert len(reads) > 40  # the walk sees the server's calls (about 100 today)
    undeclared = [f"{where}: backend.{attr} is not declared on Backend" for where, attr in reads if attr not in names]
    assert not undeclared, "\n".join(undeclared)


def test_the_contract_check_sees_names_attributes_and_annotations():
    code = (
        "import twinkle.serve.backend.images\n"
        "def f(engine, b: Backend, backend, other: MultiLoraBackend):\n"
        "    engine.backend.sample(twinkle.serve.backend.images)\n"
        "    b.streams_tokens, backend.vocab_size, other.engine\n"
        "    return lambda backend: backend.holds_adapters_here\n"
        "def g(backend: 'MultiLoraBackend'):\n"
        "    return backend.engine_lock\n"
    )
    reads = backend_reads(Path("x.py"), code)
    assert reads == [
        ("x.py:3", "sample"),
        ("x.py:4", "streams_tokens"),
        ("x.py:4", "vocab_size"),
        ("x.py:5", "holds_adapters_here"),
    ]
    assert {"sample", "vocab_size", "enable_residency", "residency_report"} <= declared()
    assert not {"streams_tokens", "holds_adapters_here", "engine"} & declared()
