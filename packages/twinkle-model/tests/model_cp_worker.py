"""TransformersModel under context parallelism, the same code in one process and under torchrun.

`torchrun --nproc_per_node=N model_cp_worker.py OUT CP` trains on a DeviceMesh of dp = N / CP and
cp = CP (model_dist_worker's LoRA scenario: SGD steps on rows of uneven length, so every row but
the longest is right-padded and the padded length 16 is cut into shards), writes OUT/rank{r}.json,
and records the refusals (left padding, packed rows, a whole-sequence loss) by their messages.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
PATCHES = ("GradientCheckpointing", "ChunkedCrossEntropy")


def dist_worker():
    if "model_dist_worker" not in sys.modules:
        spec = importlib.util.spec_from_file_location("model_dist_worker", HERE / "model_dist_worker.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_dist_worker"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_dist_worker"]


def first_gradients(mesh) -> dict[str, list]:
    """The synchronised LoRA gradients of one forward_backward on the global micro-batch."""
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel
    from twinkle.model.strategy import full_tensor

    w = dist_worker()
    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh)
    torch.manual_seed(0)
    model.add_adapter_to_model("default", w.lora_config())
    model.set_optimizer("SGD", lr=0.1)
    model.forward_backward(inputs=mesh.slice_for_data_rank(w.make_rows(w.GLOBAL_MICRO_BATCH)))
    # lora_B starts at zero, so take one step first: then lora_A's gradients are non-zero too
    model.clip_grad_and_step(max_grad_norm=None)
    model.forward_backward(inputs=mesh.slice_for_data_rank(w.make_rows(w.GLOBAL_MICRO_BATCH)))
    return {n: full_tensor(p.grad).tolist() for n, p in model._state(None).named_params()}


def refusals(mesh) -> dict[str, str]:
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    w = dist_worker()
    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh)
    model.add_adapter_to_model("default", w.lora_config())
    rows = w.make_rows(2)
    padded_left = {
        "input_ids": torch.tensor([[0, 0, *rows[0]["input_ids"][:6]], rows[1]["input_ids"][:8]]),
        "attention_mask": torch.tensor([[0, 0] + [1] * 6, [1] * 8]),
        "labels": torch.tensor([[-100, -100, *rows[0]["input_ids"][:6]], rows[1]["input_ids"][:8]]),
    }
    packed = {k: v for k, v in padded_left.items() if k != "attention_mask"}
    packed["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])
    out = {}
    for name, batch in (("left_padding", padded_left), ("packed", packed)):
        try:
            model.forward_only(inputs=batch)
        except ValueError as e:
            out[name] = str(e)
    model.set_loss("DPOLoss")
    try:
        model.forward_backward(inputs=w.make_rows(2))
    except ValueError as e:
        out["dpo"] = str(e)
    return out


def main(folder: Path, cp: int) -> None:
    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)
    world = int(os.environ["WORLD_SIZE"])
    mesh = tm.DeviceMesh.from_sizes(dp_size=world // cp, cp_size=cp)
    results = {"train": dist_worker().run_scenario("ddp", 1, mesh), "grads": first_gradients(mesh)}
    for patch in PATCHES:  # recompute in backward gathers K/V again; the chunked head reads shards
        results[patch] = dist_worker().run_scenario("ddp", 1, mesh, patch=patch)
    results["refusals"] = refusals(mesh)
    (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
