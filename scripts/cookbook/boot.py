"""Run in each recipe process before the recipe (`python boot.py MODULE ARGS...`): the served folders'
tokenizers registered under the base-model names the recipes default to, through the cookbook's own
`tokenizer_utils.register_tokenizer` (no cookbook or SDK patch); with COOKBOOK_CAPTURE set, the recipe
runs inside the cookbook's `capture_to_store` (tinker_cookbook/capture: every SDK sample and train call
recorded with its run in a local store)."""

import contextlib
import json
import os
import runpy
import sys

from tinker_cookbook import tokenizer_utils
from transformers import AutoTokenizer


def _loader(folder: str):
    return lambda: AutoTokenizer.from_pretrained(folder)


for name, folder in json.loads(os.environ["COOKBOOK_TOKENIZERS"]).items():
    tokenizer_utils.register_tokenizer(name, _loader(folder))

module, sys.argv = sys.argv[1], sys.argv[1:]
scope = contextlib.nullcontext()
if os.environ.get("COOKBOOK_CAPTURE"):
    from tinker_cookbook.capture.store import capture_to_store

    run_id, data_dir = os.environ["COOKBOOK_CAPTURE"].split("=", 1)
    scope = capture_to_store(run_id, data_dir=data_dir, idle_shutdown_minutes=5.0)
with scope:
    if module.endswith(".py"):  # one of our check scripts
        runpy.run_path(module, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
