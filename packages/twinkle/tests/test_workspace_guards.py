"""Guards on the workspace's shape: namespace ownership, declared siblings, dependency direction."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MEMBER_DIRS = sorted([*ROOT.glob("packages/*"), *ROOT.glob("apps/*")])
MEMBERS = {tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]: d for d in MEMBER_DIRS}
SEVEN = [
    "twinkle-mesh",
    "twinkle-data",
    "twinkle-model",
    "twinkle-sampler",
    "twinkle-rl",
    "twinkle-serve",
    "twinkle-client",
]
# DESIGN.md: client <- serve; mesh <- data <- model <- sampler <- rl <- serve. Each member may depend
# on the members listed here and nothing else of ours.
ALLOWED = {
    "twinkle-client": set(),
    "twinkle-mesh": set(),
    "twinkle-data": {"twinkle-mesh"},
    "twinkle-model": {"twinkle-mesh", "twinkle-data"},
    "twinkle-sampler": {"twinkle-mesh", "twinkle-data", "twinkle-model"},
    "twinkle-rl": {"twinkle-mesh", "twinkle-data", "twinkle-model", "twinkle-sampler"},
    "twinkle-serve": set(SEVEN) - {"twinkle-serve"},
    "twinkle-server": set(SEVEN),
    "twinkle-llm": set(SEVEN),
}


def _dep_name(requirement: str) -> str:
    for sep in "[<>=!~; ":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower()


def declared(dist: str, *, extras: bool = False) -> set[str]:
    """Required dependencies of `dist`; with `extras`, those of its optional extras too."""
    project = tomllib.loads((MEMBERS[dist] / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    if extras:
        requirements += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return {_dep_name(r) for r in requirements}


def owners() -> dict[str, str]:
    """`twinkle.<sub>` -> the one distribution whose src/ holds it."""
    owned: dict[str, str] = {}
    for dist, folder in MEMBERS.items():
        for sub in (folder / "src" / "twinkle").glob("*/"):
            if sub.name.startswith(("_", ".")):
                continue
            assert sub.name not in owned, f"twinkle.{sub.name} shipped by {owned.get(sub.name)} and {dist}"
            owned[sub.name] = dist
    return owned


def imported_siblings(dist: str) -> dict[str, str]:
    """Sibling distributions that `dist`'s source imports, each with one place that does it."""
    owned, found = owners(), {}
    for py in (MEMBERS[dist] / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "twinkle" and len(parts) > 1 and parts[1] in owned:
                    found.setdefault(owned[parts[1]], f"{py.relative_to(MEMBERS[dist])}:{node.lineno}")
    found.pop(dist, None)
    return found


def test_the_seven_members_meta_and_app_exist():
    assert set(SEVEN) | {"twinkle-llm", "twinkle-server"} <= set(MEMBERS)


def test_only_the_meta_distribution_ships_twinkle_init():
    shipping = sorted(d for d, f in MEMBERS.items() if (f / "src" / "twinkle" / "__init__.py").exists())
    assert shipping == ["twinkle-llm"]


def test_seed_import_paths_have_one_owner_each():
    owned = owners()
    for sub, dist in {
        "mesh": "twinkle-mesh",
        "dataset": "twinkle-data",
        "template": "twinkle-data",
        "preprocessor": "twinkle-data",
        "dataloader": "twinkle-data",
        "processor": "twinkle-data",
        "model": "twinkle-model",
        "loss": "twinkle-model",
        "metric": "twinkle-model",
        "patch": "twinkle-model",
        "sampler": "twinkle-sampler",
        "checkpoint_engine": "twinkle-sampler",
        "reward": "twinkle-rl",
        "advantage": "twinkle-rl",
        "serve": "twinkle-serve",
        "client": "twinkle-client",
    }.items():
        assert owned.get(sub) == dist, f"twinkle.{sub} should belong to {dist}, not {owned.get(sub)}"


# Extras that reach against the direction, each on purpose and named here so that none slips in.
ALLOWED_EXTRAS = {
    # opt-in: tokenize with the server's templates on the laptop; it pulls in torch, which the
    # client's own install never does (test_client_alone_in_an_empty_venv_imports_without_torch)
    ("twinkle-client", "twinkle-data"): "local-encoding",
    ("twinkle-client", "twinkle-model"): "export",  # `twinkle export --merge`: torch, only when asked for
}


@pytest.mark.parametrize("dist", sorted(ALLOWED))
def test_dependency_direction(dist):
    ours = declared(dist) & set(MEMBERS)
    assert ours <= ALLOWED[dist], f"{dist} depends on {sorted(ours - ALLOWED[dist])}, against DESIGN.md's direction"
    by_extra = (declared(dist, extras=True) - declared(dist)) & set(MEMBERS)
    against = sorted(d for d in by_extra - ALLOWED[dist] if (dist, d) not in ALLOWED_EXTRAS)
    assert not against, f"{dist}'s extras pull in {against}, against DESIGN.md's direction"


@pytest.mark.parametrize("dist", sorted(MEMBERS))
def test_every_imported_sibling_is_declared(dist):
    # An optional import (e.g. the client tokenizing locally when twinkle-data is there) must
    # still be declared, as an extra.
    missing = {d: where for d, where in imported_siblings(dist).items() if d not in declared(dist, extras=True)}
    assert not missing, f"{dist} imports undeclared siblings: {missing}"


def test_the_import_scan_sees_an_undeclared_sibling(tmp_path, monkeypatch):
    """The guard itself can fail: plant an import of twinkle.serve into the client and watch it."""
    fake = tmp_path / "twinkle-client"
    (fake / "src" / "twinkle" / "client").mkdir(parents=True)
    (fake / "pyproject.toml").write_text('[project]\nname = "twinkle-client"\ndependencies = ["httpx"]\n')
    (fake / "src" / "twinkle" / "client" / "x.py").write_text("from twinkle.serve import app\n")
    monkeypatch.setitem(MEMBERS, "twinkle-client", fake)
    assert "twinkle-serve" in imported_siblings("twinkle-client")
    assert "twinkle-serve" not in declared("twinkle-client")


def test_client_alone_in_an_empty_venv_imports_without_torch(tmp_path):
    """Exactly what a laptop user does: a fresh venv, the client only."""
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), str(MEMBERS["twinkle-client"])], check=True)
    ok = subprocess.run(
        [str(python), "-c", "import twinkle.client; print(twinkle.client.__name__)"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
