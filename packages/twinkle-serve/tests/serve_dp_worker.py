"""`torchrun --nproc_per_node=2 serve_dp_worker.py INIT OUT`: one DPO pass and one SGD step (lr 1, so the
adapter moves by exactly its gradient) on each of two data ranks, run twice:

- as the server's Ray group runs it: a `TrainShard` rank built in this process, as each actor builds one
  (an actor is a rank of a torch.distributed group with the group's DeviceMesh), given the share of the
  request that the group's dispatch (`shards.slice_items`) cuts for this rank;
- as the library runs it: `TransformersModel` over the same dp=2 DeviceMesh (DDP), given
  `mesh.slice_for_data_rank` of the same rows.

Rank 0 writes OUT/ranks.json: for each, the pass's loss, the step's gradient norm and the adapter after
the step (peft names, flattened)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BETA = 0.5


def dpo_rows() -> list[dict]:
    """Four (chosen, rejected) pairs: the two that land on data rank 0 have long completions, rank 1's
    short ones, so the ranks' shares of the loss tokens (~0.8 / 0.2) differ from their shares of the pairs."""
    rows = []
    for pair, completion in enumerate((12, 11, 2, 3)):
        prompt = [5 + 7 * pair + k for k in range(3)]
        for side in (0, 1):
            answer = [(37 * pair + 11 * side + 5 * k) % 700 + 3 for k in range(completion)]
            rows.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return rows


def adapter_weights(folder: str | Path) -> dict[str, list[float]]:
    from safetensors.torch import load_file

    return {k: v.flatten().tolist() for k, v in load_file(f"{folder}/adapter_model.safetensors").items()}


def server_group(init: str, mesh, out: Path) -> dict:
    from twinkle.hub import TEST_MODEL
    from twinkle.serve.backend.base import RowsPass
    from twinkle.serve.backend.shards import TrainShard, read_files, slice_items, write_files

    shard = TrainShard(TEST_MODEL, None)
    answers = [
        shard.load_checkpoint_files("t", read_files(init), False, False),
        shard.configure_adapter("t", "loss", "DPOLoss", {"beta": BETA}),
        shard.configure_adapter("t", "optimizer", "SGD", {"lr": 1.0}),
    ]
    assert not any(isinstance(a, Exception) for a in answers), answers
    (items,), _ = slice_items(([RowsPass("t", dpo_rows(), False)],), {}, mesh, mesh.rank)
    (outcome,) = shard.forward_backward_many(items)
    assert not isinstance(outcome, Exception), outcome
    step = shard.clip_grad_and_step("t", None)
    assert not isinstance(step, Exception), step
    files = shard.checkpoint_files("t", False)  # rank 0's answer is the group's (collect='first')
    if mesh.rank:
        return {}
    write_files(files, out / "server")
    return {"loss": outcome["loss"], "grad_norm": step["grad_norm"], "weights": adapter_weights(out / "server")}


def library(init: str, mesh, out: Path) -> dict:
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh)
    model.load(init)
    model.set_loss("DPOLoss", beta=BETA)
    model.set_optimizer("SGD", lr=1.0)
    loss = model.forward_backward(inputs=mesh.slice_for_data_rank(dpo_rows()))["loss"]
    step = model.clip_grad_and_step(max_grad_norm=None)
    folder = model.save(out / "library")  # rank 0 writes, every rank waits for it
    return {"loss": loss, "grad_norm": step["grad_norm"], "weights": adapter_weights(folder)}


def main(init: str, out: Path) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)
    mesh = tm.get_global_mesh()
    results = {"server_group": server_group(init, mesh, out), "library": library(init, mesh, out)}
    if mesh.rank == 0:
        (out / "ranks.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
