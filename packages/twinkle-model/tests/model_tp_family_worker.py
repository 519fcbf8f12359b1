"""tp=2 on every family the planner accepts: `torchrun --nproc_per_node=2 model_tp_family_worker.py OUT`
trains one LoRA (all-linear + lm_head) per family for two SGD steps and writes OUT/rank{r}.json;
the test runs `train` in its own process on a one-rank mesh and compares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

PLANNED = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "granite")


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(4):
        ids = torch.randint(3, 256, (5 + 3 * i,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def train(family: str, mesh) -> dict:
    from peft import LoraConfig

    from twinkle.model import TransformersModel
    from twinkle.model.families import tiny_config

    torch.manual_seed(0)  # the same base weights and LoRA init on every rank and in one process
    model = TransformersModel(config=tiny_config(family), device_mesh=mesh)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("SGD", lr=0.5)
    losses = []
    for _ in range(2):
        losses.append(model.forward_backward(inputs=rows())["loss"])
        model.clip_grad_and_step()
    logps = model.forward_only(inputs=rows())["logprobs"]
    # how many of the model's weights this rank holds only a shard of (0 in one process)
    sharded = sum("Shard" in repr(getattr(p, "placements", ())) for p in model.hf_model.parameters())
    return {"losses": losses, "logprobs": logps, "sharded": sharded}


def main(folder: Path) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)
    mesh = tm.DeviceMesh.from_sizes(tp_size=2)
    out = {}
    for family in PLANNED:
        out[family] = train(family, mesh)
    (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
