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
NOT_INSTALLED_HERE = {
    "megatron": "megatron-core",
    "vllm": "vllm",
    "modelscope": "modelscope",
    "wandb": "wandb",
    "mlflow": "mlflow-skinny",
    "trackio": "trackio",
    "ray": "ray",
    "yaml": "pyyaml",
    "google": "protobuf",
    "tensorboard": "tensorboard",
    "huggingface_hub": "huggingface-hub",
    "matplotlib": "matplotlib",
}
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
    ("twinkle-serve", "uvloop"): "uvicorn's event loop when installed (its per-request CPU is half of asyncio's)",
    ("twinkle-serve", "httptools"): "uvicorn's HTTP parser when installed (faster than h11)",
    (
        "twinkle-model",
        "tensorboard",
    ): "the writer behind torch.utils.tensorboard, which report_to='tensorboard' imports",
}


def _name(requirement: str) -> str:
    for sep in "[<>=!~; ":
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower().replace("_", "-")


def extras_of(dist: str) -> dict[str, set[str]]:
    project = tomllib.loads((PROJECTS[dist] / "pyproject.toml").read_text())["project"]
    return {extra: {_name(r) for r in group} for extra, group in project.get("optional-dependencies", {}).items()}


def declared(dist: str) -> tuple[set[str], set[str]]:
    project = tomllib.loads((PROJECTS[dist] / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project.get("dependencies", [])}
    return required, set().union(*extras_of(dist).values())


def _called_name(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _import_by_name_helpers(tree: ast.Module) -> set[str]:
    """`import_module` and this file's functions that pass their first argument straight to it
    (`_require("wandb", ...)`): a string literal given to one of them is a lazy import."""
    helpers = {"import_module"}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.args.args:
            first = f.args.args[0].arg
            if any(
                isinstance(c, ast.Call)
                and _called_name(c) == "import_module"
                and c.args
                and isinstance(c.args[0], ast.Name)
                and c.args[0].id == first
                for c in ast.walk(f)
            ):
                helpers.add(f.name)
    return helpers


def _imported_modules(node: ast.AST, helpers: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    if (
        isinstance(node, ast.Call)
        and _called_name(node) in helpers
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def third_party_imports(dist: str) -> dict[str, tuple[bool, str]]:
    """Top-level module -> (imported at module level somewhere, one place)."""
    found: dict[str, tuple[bool, str]] = {}
    for py in sorted((PROJECTS[dist] / "src").rglob("*.py")):
        tree = ast.parse(py.read_text(), str(py))
        in_function = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
        }
        helpers = _import_by_name_helpers(tree)
        for node in ast.walk(tree):
            modules = _imported_modules(node, helpers)
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in (
                    "twinkle",
                    "twinkle_client",
                    "twinkle_server",
                    "__future__",
                ):
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
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
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
    if dist == "twinkle-llm":
        pytest.skip("the meta distribution's dependencies are what it installs, not what it imports")
    required, _ = declared(dist)
    unused = sorted(r for r in required - imported_distributions(dist) - {dist} if (dist, r) not in USED_WITHOUT_IMPORT)
    assert not unused, f"{dist} declares {unused} but its src/ never imports them"


def imported_distributions(dist: str) -> set[str]:
    return {d for m in third_party_imports(dist) for d in distribution_of(m)} | imported_members(dist)


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_every_extra_is_imported(dist):
    """An extra is declared for code that imports it: one its src/ never imports installs for nothing."""
    imported = imported_distributions(dist) | {dist}
    unused = sorted(
        f"[{extra}] {r}"
        for extra, reqs in extras_of(dist).items()
        for r in reqs - imported
        if (dist, r) not in USED_WITHOUT_IMPORT
    )
    assert not unused, f"{dist}'s extras declare what its src/ never imports: {unused}"


def test_the_extra_scan_sees_an_unused_extra(monkeypatch, tmp_path):
    """The guard itself can fail: give the client an extra it never imports."""
    fake = tmp_path / "twinkle-client"
    (fake / "src" / "twinkle" / "client").mkdir(parents=True)
    (fake / "pyproject.toml").write_text(
        '[project]\nname = "twinkle-client"\ndependencies = ["httpx"]\n'
        '[project.optional-dependencies]\nplots = ["matplotlib>=3.8"]\n'
    )
    (fake / "src" / "twinkle" / "client" / "x.py").write_text("import httpx\n")
    monkeypatch.setitem(PROJECTS, "twinkle-client", fake)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # places are printed relative to ROOT
    with pytest.raises(AssertionError, match=r"\[plots\] matplotlib"):
        test_every_extra_is_imported("twinkle-client")
