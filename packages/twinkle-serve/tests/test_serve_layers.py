"""The shape of twinkle-serve, kept by scanning its source (AST, no imports run):
- the native and Tinker layers are translations over one core: neither imports the other;
- every SQL statement lives in the store (`serve/core/store/`);
- the core does not reach up into either API layer;
- the backend speaks the engine's terms: Tinker's datum fields, loss names and `name:reduction`
  metric names are the Tinker layer's (`serve/tinker/datums.py`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import twinkle.serve

SERVE = Path(twinkle.serve.__file__).parent
SQL = re.compile(
    r"\b(SELECT\b.+\bFROM|INSERT (OR \w+ )?INTO|UPDATE \w+ SET|DELETE FROM|CREATE (TABLE|INDEX|UNIQUE)"
    r"|ALTER TABLE|DROP TABLE|PRAGMA \w+)\b",
    re.IGNORECASE | re.DOTALL,
)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in (SERVE / folder).rglob("*.py"):
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(SERVE))] = bad
    return found


def test_native_imports_nothing_from_tinker():
    assert _offenders("native", ("twinkle.serve.tinker",)) == {}


def test_tinker_imports_nothing_from_native():
    assert _offenders("tinker", ("twinkle.serve.native",)) == {}


def test_the_core_depends_on_neither_api():
    assert _offenders("core", ("twinkle.serve.tinker", "twinkle.serve.native", "twinkle.serve.dashboard")) == {}


# What only a Tinker request says: its datum fields, its loss argument, its metric names' reductions.
TINKER_WORDS = re.compile(r"^(target_tokens|loss_fn(_inputs|_config)?|[\w/.]+:(sum|mean))$")


def _tinker_words(path: Path) -> list[str]:
    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TINKER_WORDS.match(node.value)
    ]


def test_the_backend_speaks_the_engines_terms():
    assert _offenders("backend", ("twinkle.serve.tinker", "twinkle.serve.native", "twinkle.serve.dashboard")) == {}
    named = {str(p.relative_to(SERVE)): w for p in (SERVE / "backend").rglob("*.py") if (w := _tinker_words(p))}
    assert named == {}
    assert _tinker_words(SERVE / "tinker" / "datums.py")  # the scan finds them where they belong


def test_the_scan_sees_a_violation(tmp_path):
    """The guard is not vacuous: it does find a cross-layer import where there is one."""
    probe = tmp_path / "probe.py"
    probe.write_text("from twinkle.serve.tinker.models import adapter_name\nimport twinkle.serve.native.models\n")
    assert {"twinkle.serve.tinker.models", "twinkle.serve.native.models"} <= _imports(probe)
    assert SQL.search("SELECT name FROM api_keys WHERE key_hash=?") and SQL.search("UPDATE models SET lora=?")
    assert not SQL.search("Create a training model (a run) on a base model")


def test_every_sql_statement_is_in_the_store():
    outside = {}
    for path in SERVE.rglob("*.py"):
        if "core/store" in path.as_posix():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value):
                outside.setdefault(str(path.relative_to(SERVE)), []).append(node.value[:40])
    assert outside == {}
