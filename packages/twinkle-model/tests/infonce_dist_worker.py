"""InfonceLoss with in-batch negatives over two data-parallel processes: `torchrun --nproc_per_node=2
infonce_dist_worker.py OUT` trains one LoRA step on each rank's groups (uneven: 4 and 5 rows) and writes
OUT/rank{r}.json (the reported loss, the synchronised LoRA gradients); the test runs `step` on the whole
batch in one process and compares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

# (input_ids, group mark): four groups; the third has a hard negative
ROWS = [
    ([21, 22, 23, 24], 1),
    ([21, 22, 25], 0),
    ([31, 32], 1),
    ([31, 33, 34, 35, 36], 0),
    ([41, 42, 43], 1),
    ([44, 42, 43], 0),
    ([47, 48, 49, 50], 0),
    ([51, 52, 53], 1),
    ([51, 54], 0),
]
SPLIT = 4  # rank 0 holds rows [0, 4): groups 0 and 1; rank 1 the rest: groups 2 and 3
LOSS = {"temperature": 0.5, "include_qq": True, "include_dd": True}


def rows(part: slice) -> list[dict]:
    return [{"input_ids": ids, "labels": [mark]} for ids, mark in ROWS[part]]


def step(mesh, part: slice) -> dict:
    from peft import LoraConfig

    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    # twinkle-kit's Usage Guide asks DDP to allow unused parameters in an embedding pass
    model = TransformersModel(
        model_id=TEST_MODEL, device_mesh=mesh, strategy="ddp", ddp_config={"find_unused_parameters": True}
    )
    torch.manual_seed(0)  # the same LoRA on every rank and in the one-process run
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_loss("InfonceLoss", **LOSS)
    model.set_optimizer("SGD", lr=0.1)
    loss = model.forward_backward(inputs=rows(part), task="embedding")["loss"]
    grads = {n: p.grad.flatten().tolist() for n, p in model.optimizer_group["default"].state.named_params()}
    return {"loss": loss, "grads": grads, "find_unused": getattr(model._wrapped, "find_unused_parameters", None)}


def main(folder: Path) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)  # joins the gloo group torchrun set up
    rank = int(os.environ["RANK"])
    mesh = tm.DeviceMesh.from_sizes(dp_size=int(os.environ["WORLD_SIZE"]))
    out = step(mesh, slice(0, SPLIT) if rank == 0 else slice(SPLIT, None))
    (folder / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
