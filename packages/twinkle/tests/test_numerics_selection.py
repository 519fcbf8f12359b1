"""The `numerics` nox session reruns the float-comparing suites under other CPUs' kernels and leaves out
the tests marked `no_float` (a route, a refusal, a store, an error message: nothing a kernel can change).
The mark is a promise this file holds: no test carrying it compares with a tolerance, neither in its own
body nor in a helper or fixture it reaches (module-level functions of its file, its folder's helper
modules, the conftest.py files above it). A float test marked by mistake fails here instead of silently
leaving the numerics run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TEST_DIRS = [*ROOT.glob("packages/*/tests"), *ROOT.glob("apps/*/tests"), ROOT / "tests"]
# How this workspace compares floats: torch.testing / numpy / math helpers, pytest.approx, and any
# call spelling a tolerance.
TOLERANCE = re.compile(r"assert_close|allclose|isclose|\bapprox\b|assert_almost_equal|\brtol\b|\batol\b")
MARK = "no_float"

Functions = dict[str, ast.FunctionDef | ast.AsyncFunctionDef]


def _has_mark(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == MARK for n in ast.walk(node))


def _functions(tree: ast.Module) -> Functions:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _module_marked(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets) and _has_mark(n)
        for n in tree.body
    )


def _marked_tests(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    whole = _module_marked(tree)
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls = whole or any(_has_mark(d) for d in node.decorator_list)
            out += [
                f
                for f in _functions(ast.Module(body=node.body, type_ignores=[])).values()
                if f.name.startswith("test_") and (cls or any(_has_mark(d) for d in f.decorator_list))
            ]
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test_")
            and (whole or any(_has_mark(d) for d in node.decorator_list))
        ):
            out.append(node)
    return out


def _reachable_helpers(path: Path, tree: ast.Module) -> Functions:
    """Every function a test in `path` may reach by name: its own module's first, then its folder's other
    modules (helpers such as harness.py) and the conftest.py files from its folder up to the root."""
    found: Functions = {}
    sources = [path, *sorted(p for p in path.parent.glob("*.py") if p != path)]
    folder = path.parent
    while folder != ROOT and ROOT in folder.parents:
        folder = folder.parent
        sources.append(folder / "conftest.py")
    sources.append(ROOT / "conftest.py")
    for source in sources:
        if source.is_file():
            module = tree if source == path else ast.parse(source.read_text())
            for name, fn in _functions(module).items():
                found.setdefault(name, fn)
    return found


def _tolerance_in(test: ast.FunctionDef | ast.AsyncFunctionDef, helpers: Functions) -> str | None:
    """The first function reachable from `test` (by a name it uses or a fixture it asks for) whose source
    spells a tolerance: 'name: line'; None if there is none."""
    seen: set[str] = set()
    todo = [test]
    while todo:
        fn = todo.pop()
        if fn.name in seen:
            continue
        seen.add(fn.name)
        text = ast.unparse(fn)
        hit = TOLERANCE.search(text)
        if hit:
            line = text[: hit.start()].count("\n") + fn.lineno
            return f"{fn.name} (near line {line}: {hit.group()})"
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
        names |= {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        todo += [helpers[n] for n in names if n in helpers and n not in seen]
    return None


def _marked() -> list[tuple[Path, ast.Module]]:
    out = []
    for folder in TEST_DIRS:
        for path in sorted(folder.rglob("test_*.py")):
            text = path.read_text()
            if MARK in text:
                out.append((path, ast.parse(text)))
    return out


def test_no_float_tests_compare_nothing_with_a_tolerance():
    wrong = []
    for path, tree in _marked():
        helpers = _reachable_helpers(path, tree)
        for test in _marked_tests(tree):
            where = _tolerance_in(test, helpers)
            if where:
                wrong.append(f"{path.relative_to(ROOT)}::{test.name} reaches a tolerance in {where}")
    assert not wrong, "marked no_float but compares floats (remove the mark):\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "source, reason",
    [
        ("import pytest\npytestmark = pytest.mark.no_float\ndef test_a():\n    assert 1 == pytest.approx(1)\n", "own"),
        (
            "import pytest\ndef check(a, b):\n    torch.testing.assert_close(a, b)\n"
            "@pytest.mark.no_float\ndef test_a():\n    check(1, 1)\n",
            "helper",
        ),
        (
            "import pytest\n@pytest.fixture\ndef run():\n    return compare(rtol=1e-5)\n"
            "@pytest.mark.no_float\ndef test_a(run):\n    assert run\n",
            "fixture",
        ),
        (
            "import pytest\n@pytest.mark.no_float\nclass TestA:\n    def test_a(self):\n"
            "        assert math.isclose(1.0, 1.0)\n",
            "class",
        ),
    ],
)
def test_the_check_catches_a_float_test_marked_no_float(source, reason):
    tree = ast.parse(source)
    tests = _marked_tests(tree)
    assert tests, reason
    assert all(_tolerance_in(t, _functions(tree)) for t in tests), reason


def test_the_check_passes_a_test_that_compares_no_float():
    source = "import pytest\n@pytest.mark.no_float\ndef test_a():\n    assert 'bad' in str(ValueError('bad'))\n"
    tree = ast.parse(source)
    (test,) = _marked_tests(tree)
    assert _tolerance_in(test, _functions(tree)) is None


def test_the_mark_is_registered_and_the_numerics_session_leaves_it_out():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{MARK}:' in pyproject, "register the mark in the root pyproject's [tool.pytest.ini_options]"
    assert f"not {MARK}" in (ROOT / "noxfile.py").read_text()
