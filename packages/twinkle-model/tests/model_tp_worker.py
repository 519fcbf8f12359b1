"""Tensor-parallel scenarios under torchrun: `torchrun --nproc_per_node=N model_tp_worker.py OUT`
runs every scenario of SCENARIOS[N] (TransformersModel on a mesh with tp=2, LoRA and
full-parameter, alone and with dp) and writes OUT/rank{r}.json plus one save per scenario. The
scenario steps are model_dist_worker.run_scenario's, so the one-process reference is the same code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

# (name, mesh sizes, gradient accumulation, LoRA?, patch) per world size
SCENARIOS = {
    2: (
        ("tp2-lora-gas2", {"tp_size": 2}, 2, True, None),
        ("tp2-full", {"tp_size": 2}, 1, False, None),
        ("tp2-lora-chunked-ce", {"tp_size": 2}, 1, True, "ChunkedCrossEntropy"),
    ),
    4: (
        ("dp2-tp2-lora", {"dp_size": 2, "tp_size": 2}, 1, True, None),
        ("fsdp2-tp2-full", {"dp_size": 1, "fsdp_size": 2, "tp_size": 2}, 1, False, None),
    ),
}


def load_dist_worker():
    # From its file: the tests folder is not a package and its name must not clash with other members'.
    if "model_dist_worker" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "model_dist_worker", Path(__file__).with_name("model_dist_worker.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_dist_worker"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_dist_worker"]


def two_adapters(mesh) -> dict:
    """Adapter 'a' steps, then 'b' is added (after the first forward: the tp plan places it on
    its first forward) and steps, then 'a' again."""
    from peft import LoraConfig

    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    worker = load_dist_worker()
    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh)
    torch.manual_seed(0)
    batches = [mesh.slice_for_data_rank(b) for b in worker.micro_batches(1)]
    losses = []

    def train(name: str, batch) -> None:
        losses.append(model.forward_backward(inputs=batch, adapter_name=name)["loss"])
        model.clip_grad_and_step(adapter_name=name)

    model.add_adapter_to_model("a", worker.lora_config())
    model.set_optimizer("SGD", adapter_name="a", **worker.OPTIMIZER)
    train("a", batches[0])
    model.add_adapter_to_model("b", LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "up_proj"]))
    model.set_optimizer("SGD", adapter_name="b", **worker.OPTIMIZER)
    train("b", batches[1])
    train("a", batches[2])
    return {"losses": losses, "a": worker.trained_weights(model, "a"), "b": worker.trained_weights(model, "b")}


def main(folder: Path) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)  # joins the gloo group torchrun set up
    worker = load_dist_worker()
    results = {}
    for name, sizes, gas, lora, patch in SCENARIOS[int(os.environ["WORLD_SIZE"])]:
        mesh = tm.DeviceMesh.from_sizes(**sizes)
        results[name] = worker.run_scenario(None, gas, mesh, folder / name, lora=lora, patch=patch)
    if int(os.environ["WORLD_SIZE"]) == 2:
        results["two-adapters"] = two_adapters(tm.DeviceMesh.from_sizes(tp_size=2))
    (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
