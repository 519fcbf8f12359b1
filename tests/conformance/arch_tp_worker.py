"""tp=2 for the architecture matrix: `torchrun --nproc_per_node=2 arch_tp_worker.py OUT` builds every
family on a tp=2 mesh; those the planner accepts train the server's LoRA (attention + MLP + head)
for two SGD steps, the rest record the refusal. Writes OUT/rank{r}.json; the test runs `train` in
its own process on a one-rank mesh and compares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import arch_cells


def train(family: str, mesh) -> dict:
    from twinkle.model import TransformersModel
    from twinkle.model.families import tiny_config

    torch.manual_seed(0)  # the same base weights and LoRA init on every rank and in one process
    try:
        model = TransformersModel(config=tiny_config(family), device_mesh=mesh)
    except ValueError as refusal:  # refused at construction, by name
        return {"refused": str(refusal)}
    model.add_adapter_to_model("default", arch_cells.lora_config(model.hf_model))
    model.set_optimizer("SGD", lr=0.5)
    losses = []
    for _ in range(2):
        losses.append(model.forward_backward(inputs=arch_cells.rows(7))["loss"])
        model.clip_grad_and_step()
    logps = model.forward_only(inputs=arch_cells.rows(8))["logprobs"]
    # how many of the model's weights this rank holds only a shard of (0 in one process)
    sharded = sum("Shard" in repr(getattr(p, "placements", ())) for p in model.hf_model.parameters())
    return {"losses": losses, "logprobs": logps, "sharded": sharded}


def main(folder: Path) -> None:
    import twinkle.mesh as tm
    from twinkle.model.families import FAMILIES

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)
    mesh = tm.DeviceMesh.from_sizes(tp_size=2)
    out = {family: train(family, mesh) for family in FAMILIES}
    (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
