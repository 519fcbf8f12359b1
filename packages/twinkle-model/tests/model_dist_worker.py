"""TransformersModel LoRA training, the same code in one process and under torchrun.

`torchrun --nproc_per_node=2 model_dist_worker.py OUT` runs every scenario (DDP and FSDP2, with and
without gradient accumulation; FSDP2 chosen by the mesh's fsdp_size alone) in one launch and writes OUT/rank{r}.json plus one PEFT save per
scenario; the tests run `run_scenario` in their own process with a one-rank mesh and compare.

Each scenario: a fixed global micro-batch sequence, every rank training on its data slice of it.
After every forward_backward a probe records whether the gradients were synchronised:
`has_grad` (FSDP2 only reduce-scatters into the sharded .grad on a sync) and `digest` (the sum of
this rank's gradients; DDP ranks agree exactly when, and only when, the all-reduce ran).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

STEPS = 3  # optimizer steps per scenario
GLOBAL_MICRO_BATCH = 4  # rows per micro-batch, over all ranks
SCENARIOS = (("ddp", 1), ("fsdp2", 1), ("ddp", 2), ("fsdp2", 2))  # (strategy, gradient accumulation)
# SGD with momentum: linear in the gradient, so fp32 reduction-order noise (~1e-7) stays that small;
# Adam would amplify it on near-zero gradient entries (its update is ~lr whatever the size).
OPTIMIZER = dict(lr=0.5, momentum=0.9, weight_decay=0.01)
FULL_OPTIMIZER = dict(lr=0.05, momentum=0.9)  # every weight moves: a smaller step keeps the loss finite


def make_rows(n: int, vocab: int = 850) -> list[dict]:
    """Rows of uneven length (so ranks hold different token counts), the prompt masked out."""
    g = torch.Generator().manual_seed(2024)
    rows = []
    for i in range(n):
        length = 6 + (i * 7) % 11
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt = 1 + i % 4
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def micro_batches(gas: int) -> list[list[dict]]:
    rows = make_rows(STEPS * gas * GLOBAL_MICRO_BATCH)
    return [rows[i : i + GLOBAL_MICRO_BATCH] for i in range(0, len(rows), GLOBAL_MICRO_BATCH)]


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def _grad_probe(model) -> dict:
    from twinkle.model.strategy import full_tensor

    params = model._state(None).params
    if any(p.grad is None for p in params):
        return {"has_grad": False, "digest": None}
    return {"has_grad": True, "digest": sum(float(full_tensor(p.grad).double().sum()) for p in params)}


def trained_weights(model, adapter_name: str | None = None) -> dict[str, list]:
    from twinkle.model.strategy import full_tensor

    return {n: full_tensor(p.detach()).tolist() for n, p in model._state(adapter_name).named_params()}


def run_scenario(
    strategy: str | None, gas: int, mesh, save_dir: Path | None = None, lora: bool = True, patch: str | None = None
) -> dict:
    """LoRA (or, with lora=False, full-parameter) training; `strategy=None` lets the mesh choose."""
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh, strategy=strategy)
    if patch is not None:
        model.apply_patch(patch)
    torch.manual_seed(0)  # identical LoRA init on every rank and in the one-process run
    if lora:
        model.add_adapter_to_model("default", lora_config(), gradient_accumulation_steps=gas)
    elif gas != 1:
        raise ValueError("the full-parameter scenarios step every micro-batch")
    model.set_optimizer("SGD", **(OPTIMIZER if lora else FULL_OPTIMIZER))
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=STEPS + 1)
    out = {"losses": [], "grad_norms": [], "probes": [], "stepped": []}
    for batch in micro_batches(gas):
        out["losses"].append(model.forward_backward(inputs=mesh.slice_for_data_rank(batch))["loss"])
        out["probes"].append(_grad_probe(model))
        step = model.clip_grad_and_step()
        out["stepped"].append(step["stepped"])
        if step["stepped"]:
            out["grad_norms"].append(step["grad_norm"])
    out["weights"] = trained_weights(model)
    out["logprobs"] = model.forward_only(inputs=mesh.slice_for_data_rank(make_rows(GLOBAL_MICRO_BATCH)))["logprobs"]
    out["strategy"], out["wrapped"] = model.strategy, type(model._wrapped).__name__
    out["layout"] = {
        n: [[repr(x) for x in p.placements], list(p.to_local().shape)]
        for n, p in model._state(None).named_params()
        if hasattr(p, "placements")
    }  # how each DTensor parameter is placed and what this rank holds
    if save_dir is not None:
        model.save(save_dir)
    return out


def main(folder: Path) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)  # joins the gloo group torchrun set up
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    fsdp_mesh = tm.DeviceMesh.from_sizes(dp_size=1, fsdp_size=world)
    for strategy, gas in SCENARIOS:
        mesh = tm.DeviceMesh.from_sizes(dp_size=world) if strategy == "ddp" else fsdp_mesh
        name = f"{strategy}-gas{gas}"
        # FSDP2 scenarios pass no strategy: fsdp_size alone must select it
        results[name] = run_scenario(strategy if strategy == "ddp" else None, gas, mesh, folder / name)
    try:
        run_scenario("ddp", 1, fsdp_mesh)
    except ValueError as e:
        results["ddp-on-fsdp-mesh"] = str(e)
    rank = int(os.environ["RANK"])
    (folder / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
