"""What one module may know of another, over every member's src/:

- no private attribute of another object (`engine._state`): a module reads its own `self._x` and the
  public names of everything else, so a refactor of one class cannot silently break another module;
- no private name imported from another module (`from ... import _helper`);
- no capability probing of a serving backend or engine (`hasattr(backend, ...)`, `getattr(backend,
  "x", default)`) in twinkle-serve: the Backend protocol declares its capabilities, and callers read
  the declaration. (Probing a third-party object across its versions, as the vLLM sampler does, is
  another matter.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROBED = ("backend", "engine")  # objects whose capabilities are declared, not discovered


def sources() -> list[Path]:
    return sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _names_probed(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return any(word in name.lower() for word in PROBED)


def violations(path: Path, text: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        where = f"{path.relative_to(ROOT) if path.is_absolute() else path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            # super()._x is this object's own method, as a subclass that extends it calls it
            base = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            if not (own or base):
                found.append(f"{where}: reads another object's private .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("twinkle"):
            found += [f"{where}: imports private {a.name} from {node.module}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
            if probe and _names_probed(node.args[0]) and "twinkle-serve" in str(path):
                found.append(f"{where}: probes {ast.unparse(node.args[0])} with {node.func.id}: declare it instead")
    return found


def test_modules_use_each_others_public_names_and_declared_capabilities():
    files = sources()
    assert len(files) > 100
    problems = [v for path in files for v in violations(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_the_check_sees_each_kind_of_violation():
    code = (
        "from twinkle.serve.backend.resident import _lock\n"
        "def f(self, backend, engine):\n"
        "    self._fine = engine._state('a')\n"
        "    super()._extended(self._fine)\n"
        "    if hasattr(backend, 'streams_tokens') or getattr(self.engine, 'x', None):\n"
        "        return backend.__class__, getattr(backend, 'declared')\n"
    )
    found = violations(Path("packages/twinkle-serve/src/x.py"), code)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports private _lock from twinkle.serve.backend.resident",
        "reads another object's private ._state",
        "probes backend with hasattr: declare it instead",
        "probes self.engine with getattr: declare it instead",
    ]


# An adapter's window counters and non-finite flag change only through AdapterState's own methods
# (count_micro_batch, end_window, restore, set_counters) and the step rule, so no serving layer can
# put one rank's or one tenant's window out of step by writing them from outside.
COUNTERS = {"micro_step", "consumed_batches", "optimizer_steps", "nonfinite_pending"}
OWNERS = ("packages/twinkle-model/src/twinkle/model/state.py", "packages/twinkle-model/src/twinkle/model/step.py")


def counter_writes(path: Path, text: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        found += [
            f"{path.relative_to(ROOT) if path.is_absolute() else path}:{node.lineno}: writes .{t.attr} of an adapter state"
            for t in flat
            if isinstance(t, ast.Attribute) and t.attr in COUNTERS
        ]
    return found


def test_adapter_counters_change_only_through_the_state_and_the_step_rule():
    owners = {ROOT / p for p in OWNERS}
    problems = [v for path in sources() if path not in owners for v in counter_writes(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_the_counter_check_sees_plain_tuple_and_augmented_writes():
    code = "def f(state):\n    state.micro_step += 1\n    state.a, state.nonfinite_pending = 1, False\n    state.end_window()\n"
    found = counter_writes(Path("x.py"), code)
    assert [line.split(": ", 1)[1] for line in found] == [
        "writes .micro_step of an adapter state",
        "writes .nonfinite_pending of an adapter state",
    ]
