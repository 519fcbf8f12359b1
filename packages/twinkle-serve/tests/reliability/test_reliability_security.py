"""Security properties that need no running server: nothing on the request path can unpickle or
evaluate what a client sends, and code inside a model folder is not run unless the operator opts in."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

import twinkle.client
import twinkle.serve

# The code paths that parse requests: the whole server package, and the wire schema it validates with.
SCANNED = [Path(twinkle.serve.__file__).parent, *(Path(p) for p in twinkle.client.__path__)]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "jsonpickle"}


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}:{node.lineno} from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if isinstance(f, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where}:{node.lineno} {name}()")
            elif owner == "torch" and name == "load" and not _is_true(_kw(node, "weights_only")):
                found.append(f"{where}:{node.lineno} torch.load without weights_only=True")
            elif owner == "yaml" and name in ("load", "unsafe_load", "full_load", "load_all"):
                found.append(f"{where}:{node.lineno} yaml.{name}")
            elif owner in ("np", "numpy") and name == "load" and _is_true(_kw(node, "allow_pickle")):
                found.append(f"{where}:{node.lineno} np.load(allow_pickle=True)")
            elif _is_true(_kw(node, "trust_remote_code")):
                found.append(f"{where}:{node.lineno} trust_remote_code=True")
    return found


def test_the_scan_catches_what_it_looks_for():
    bad = ("import pickle\nfrom dill import loads\neval(x)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
           "yaml.load(s)\nnp.load(f, allow_pickle=True)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n")
    assert len(unsafe_calls(bad, "probe")) == 8
    assert unsafe_calls("torch.load(f, weights_only=True)\nyaml.safe_load(s)\nmodel.eval()\n", "probe") == []


def test_nothing_on_the_request_path_unpickles_or_evaluates():
    files = [p for root in SCANNED for p in root.rglob("*.py")]
    assert len(files) > 20, files
    found = [hit for p in files for hit in unsafe_calls(p.read_text(), str(p))]
    print(f"\nsecurity scan: {len(files)} modules of twinkle.serve + twinkle.client, unsafe calls: {found}")
    assert not found, found


def test_model_folder_code_is_not_run_by_default(tmp_path):
    """A model folder whose config names custom code (auto_map) is refused, and the code never runs."""
    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend import create_backend
    from twinkle.serve.config import ModelEntry

    folder = tmp_path / "evil-model"
    shutil.copytree(resolve_model_path(TEST_MODEL), folder)
    marker = tmp_path / "code-ran"
    (folder / "evil_config.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3Config\nclass EvilConfig(Qwen3Config):\n    model_type = 'evil-qwen3'\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil_config.EvilConfig"}
    config["model_type"] = "evil-qwen3"  # unknown to transformers: only the folder's own code could load it
    (folder / "config.json").write_text(json.dumps(config))
    assert ModelEntry(name="evil").trust_remote_code is False  # the operator's opt-in defaults to off
    with pytest.raises(Exception) as err:
        create_backend("multi_lora", "evil", str(folder))
    assert "trust_remote_code" in str(err.value), err.value
    assert not marker.exists()
