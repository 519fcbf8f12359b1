"""Every third-party import in a member's src/ is declared by that member, and every declared
dependency is imported: the check deptry makes, done here because deptry cannot see that `twinkle`
is a namespace shared by nine distributions.

An import at module level must be a required dependency; one inside a function (the lazy import of
an optional backend) may instead come from one of the member's extras. Extras of ours follow the
dependency direction like required dependencies do (test_workspace_guards checks that with
`extras=True`).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MEMBER_DIRS = sorted([*ROOT.glob("packages/*"), *ROOT.glob("apps/*")])
PROJECTS = {tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]: d for d in MEMBER_DIRS}
# Import names whose distribution is not installed in this environment (optional backends), by hand.
NOT_INSTALLED_HERE = {"megatron": "megatron-core", "vllm": "vllm", "modelscope": "modelscope", "wandb": "wandb",
                      "mlflow": "mlflow-skinny", "trackio": "trackio", "ray": "ray", "yaml": "pyyaml",
                      "google": "protobuf", "tensorboard": "tensorboard", "huggingface_hub": "huggingface-hub",
                      "matplotlib": "matplotlib"}
# Modules that only their optional backend's users import: their module-level imports may come from
# an extra (the module itself is imported lazily, by the code path that needs that backend).
OPTIONAL_BACKEND_MODULES = {
    "packages/twinkle-mesh/src/twinkle/mesh/ray_group.py": "ray mode (twinkle-mesh[ray])",
    "packages/twinkle-sampler/src/twinkle/checkpoint_engine/ray_engine.py": "twinkle-sampler[ray]",
    "packages/twinkle-sampler/src/twinkle/sampler/vllm_sampler.py": "twinkle-sampler[vllm]",
}
# Declared but never imported by name, each for a reason.
USED_WITHOUT_IMPORT = {
    ("twinkle-data", "tokenizers"): "the fast tokenizer backend transformers loads tokenizer.json with",
    ("twinkle-serve", "uvicorn"): "imported by the server module at run time",
}


def _name(requirement: str) -> str:
    for sep in "[<>=!~; ":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower().replace("_", "-")


def declared(dist: str) -> tuple[set[str], set[str]]:
    project = tomllib.loads((PROJECTS[dist] / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project.get("dependencies", [])}
    extras = {_name(r) for group in project.get("optional-dependencies", {}).values() for r in group}
    return required, extras


def third_party_imports(dist: str) -> dict[str, tuple[bool, str]]:
    """Top-level module -> (imported at module level somewhere, one place)."""
    found: dict[str, tuple[bool, str]] = {}
    for py in sorted((PROJECTS[dist] / "src").rglob("*.py")):
        tree = ast.parse(py.read_text(), str(py))
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("twinkle", "twinkle_server", "__future__"):
                    continue
                eager = id(node) not in in_function and str(py.relative_to(ROOT)) not in OPTIONAL_BACKEND_MODULES
                was_eager = found.get(top, (False, ""))[0]
                if top not in found or (eager and not was_eager):
                    found[top] = (eager or was_eager, f"{py.relative_to(ROOT)}:{node.lineno}")
    return found


def distribution_of(module: str) -> set[str]:
    names = {_name(d) for d in packages_distributions().get(module, [])}
    if names:
        return names
    return {NOT_INSTALLED_HERE[module]} if module in NOT_INSTALLED_HERE else set()


def imported_members(dist: str) -> set[str]:
    """Our own distributions whose `twinkle.<name>` modules `dist`'s src imports."""
    owner = {}
    for other, folder in PROJECTS.items():
        for entry in (folder / "src" / "twinkle").glob("*"):
            if entry.name != "__init__.py" and not entry.name.startswith((".", "_")):
                owner[entry.name.removesuffix(".py")] = other
    found = set()
    for py in (PROJECTS[dist] / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for m in modules:
                parts = m.split(".")
                if parts[0] == "twinkle" and len(parts) > 1 and parts[1] in owner:
                    found.add(owner[parts[1]])
    return found


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_every_third_party_import_is_declared(dist):
    required, extras = declared(dist)
    problems = []
    for module, (eager, where) in sorted(third_party_imports(dist).items()):
        dists = distribution_of(module)
        if not dists:
            problems.append(f"{where}: imports {module!r}, which no installed distribution provides")
        elif eager and not dists & required:
            problems.append(f"{where}: imports {module!r} at module level but {dist} does not require {sorted(dists)}")
        elif not dists & (required | extras):
            problems.append(f"{where}: imports {module!r} but {dist} declares none of {sorted(dists)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_every_declared_dependency_is_imported(dist):
    if dist == "twinkle":
        pytest.skip("the meta distribution's dependencies are what it installs, not what it imports")
    required, _ = declared(dist)
    imported = {d for m in third_party_imports(dist) for d in distribution_of(m)} | imported_members(dist)
    unused = sorted(r for r in required - imported - {dist} if (dist, r) not in USED_WITHOUT_IMPORT)
    assert not unused, f"{dist} declares {unused} but its src/ never imports them"
