"""The server the recipes run against, and the folder each recipe runs in.

The server serves the embedded demo model, and the embedded tiny vision-language model, each under the
base-model names the recipes hard-code, as config aliases (`ModelEntry.aliases`: one engine per model,
whatever name a client sends). The demo model is served with a 262,144-token context (RoPE; the tiny
model is not good there, only served), the context rl_numerics_check's `...:peft:262144` asks for.

The cookbook loads tokenizers by name (registered in each recipe process: boot.py) and image processors
and base-model files by name through transformers / huggingface_hub, which take a local folder first:
each recipe's working folder holds `<org>/<name>` links to the served folders.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

CONTEXT = 262144
REQUEST_TOKENS = 4 * CONTEXT  # caps.max_request_tokens: what one request may cost (core/cost.py)
TEXT_NAMES = [  # the text base models the recipes default to (CLIConfig.model_name, teacher, answerer, ...)
    "Qwen/Qwen3.5-9B",
    "Qwen/Qwen3.6-35B-A3B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3.5-4B",
    "Qwen/Qwen3.5-9B-Base",
    "Qwen/Qwen3.8-27B",
]
VISION_NAMES = ["Qwen/Qwen3.5-397B-A17B"]  # vlm_classifier's default
TEXT_MODEL, VISION_MODEL = "twinkle://qwen3-demo", "twinkle://qwen2.5-vl-tiny"


@dataclass
class Served:
    url: str
    key: str
    folders: dict[str, Path]  # every served name (aliases too) -> its model folder


def long_context_folder(root: Path) -> Path:
    """The embedded demo model with its context raised to CONTEXT: its files linked, its config rewritten."""
    from twinkle.hub import resolve_model_path

    src, dst = Path(resolve_model_path(TEXT_MODEL)), root / "demo-long"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def start(root: Path):
    """-> (server handle, Served)."""
    import twinkle.serve as ts
    from twinkle.hub import resolve_model_path

    text, vision = long_context_folder(root), Path(resolve_model_path(VISION_MODEL))
    models = [
        {"name": TEXT_MODEL, "path": str(text), "aliases": TEXT_NAMES},
        {"name": VISION_MODEL, "path": str(vision), "aliases": VISION_NAMES},
    ]
    # The recipes' own batches: an RL step of twenty_questions is one training request of ~90K padded
    # tokens (rows x longest row), past the default per-request budget of 32,768; this operator allows it.
    config = {"models": models, "caps": {"max_request_tokens": REQUEST_TOKENS}}
    srv = ts.initialize(
        mode="http", port=0, data_dir=root / "data", config=config, block=False, log_level="warning"
    ).wait_ready()
    folders = {n: text for n in TEXT_NAMES} | {n: vision for n in VISION_NAMES}
    return srv, Served(srv.url, srv.create_key("cookbook"), folders)


def recipe_env(served: Served) -> dict[str, str]:
    here = Path(__file__).resolve().parent
    return {
        **os.environ,
        "TINKER_BASE_URL": served.url,
        "TINKER_API_KEY": served.key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "COOKBOOK_TOKENIZERS": json.dumps({n: str(f) for n, f in served.folders.items()}),
        # the local verifiers environment (envs/reverse_text.py), importable as verifiers loads one
        "PYTHONPATH": os.pathsep.join([str(here / "envs"), os.environ.get("PYTHONPATH", "")]),
    }


def recipe_folder(root: Path, name: str, served: Served) -> Path:
    """A fresh working folder for one recipe, with `<org>/<name>` links to the served model folders."""
    work = root / "work" / name
    work.mkdir(parents=True)
    for hub_id, folder in served.folders.items():
        link = work / hub_id
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(folder)
    return work


def boot_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve().parent / "boot.py"), module, *args]
