"""A small LoRA training step in plain torch + peft, run the same way in one process, under torchrun
(DDP, FSDP2, tensor parallel) and as a Ray remote group. Imported by the tests, and the torchrun
entry point itself (`torchrun --nproc_per_node=2 mesh_steps.py OUT`).

The loss is a token mean over the *global* batch: each rank divides its summed token loss by the
global token count and, because DDP/FSDP average gradients over ranks, scales by the data world
size. That is what makes a sharded step equal to the one-process step on uneven, padded rows.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle.mesh import DeviceMesh, RemoteClass, get_global_mesh, remote_method

STEPS = 3
GLOBAL_BATCH = 4
LR = 0.5


def make_rows(n: int = STEPS * GLOBAL_BATCH, vocab: int = 850) -> list[dict]:
    """Encoded rows of uneven length; the first tokens of each are prompt (label -100)."""
    g = torch.Generator().manual_seed(1234)
    rows = []
    for i in range(n):
        length = 8 + (i * 5) % 13
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt = 2 + i % 4
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids_B_T = torch.zeros(len(rows), width, dtype=torch.long)
    labels_B_T = torch.full((len(rows), width), -100, dtype=torch.long)
    mask_B_T = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids_B_T[i, :n], labels_B_T[i, :n], mask_B_T[i, :n] = (
            torch.tensor(r["input_ids"]),
            torch.tensor(r["labels"]),
            1,
        )
    return {"input_ids": ids_B_T, "labels": labels_B_T, "attention_mask": mask_B_T}


def build_model(lora: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path

    torch.manual_seed(0)  # identical LoRA init on every rank and in every mode
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(TEST_MODEL), dtype=torch.float32, attn_implementation="eager"
    )
    if lora:
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    model.train()
    return model


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def step(model, optimizer, rows: list[dict], data_group=None, data_world: int = 1) -> float:
    """One optimizer step on this rank's rows; returns the global-batch token-mean loss."""
    batch = collate(rows)
    logits_B_T_V = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels_B_T = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(
        logits_B_T_V[:, :-1].reshape(-1, logits_B_T_V.shape[-1]).float(),
        labels_B_T.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    tokens = _reduce((labels_B_T != -100).sum().float(), data_group)
    (loss_sum / tokens * data_world).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (_reduce(loss_sum.detach().clone(), data_group) / tokens).item()


def lora_weights(model) -> dict[str, torch.Tensor]:
    """Full (gathered) LoRA tensors under names free of wrapper prefixes."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.removeprefix("module.")] = full.detach().clone()
    return out


class LoraTrainer(metaclass=RemoteClass):
    """The step as a component: `parallel` picks how the data ranks share it."""

    def __init__(self, device_mesh: DeviceMesh | None = None, parallel: str = "ddp"):
        self.mesh = device_mesh or get_global_mesh()
        self.model = build_model()
        self.group = None
        if self.mesh.data_world_size > 1:
            self.group = self.mesh.get_group("data")
            if parallel == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                self.model = DistributedDataParallel(self.model, process_group=self.group)
            elif parallel == "fsdp":
                from torch.distributed.fsdp import fully_shard

                fsdp_mesh = self.mesh.to_torch()["fsdp"]
                for layer in self.model.base_model.model.model.layers:
                    fully_shard(layer, mesh=fsdp_mesh)
                fully_shard(self.model, mesh=fsdp_mesh)
            else:
                raise ValueError(f"parallel={parallel!r}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=LR)

    @remote_method(dispatch="slice", collect="first")
    def train_step(self, rows: list[dict]) -> float:
        return step(self.model, self.optimizer, rows, self.group, self.mesh.data_world_size)

    @remote_method(collect="first")
    def lora_state(self) -> dict[str, torch.Tensor]:
        return lora_weights(self.model)

    @remote_method(collect="all")
    def whoami(self) -> dict:
        return {
            "rank": self.mesh.rank,
            "data_rank": self.mesh.data_rank,
            "pid": os.getpid(),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "threads": torch.get_num_threads(),
        }

    @remote_method(dispatch="slice", collect="flatten")
    def row_lengths(self, rows: list[dict], extra: int = 0) -> list[int]:
        return [len(r["input_ids"]) + extra for r in rows]

    @remote_method(dispatch="slice", collect="mean")
    def row_count(self, rows: list[dict]) -> float:
        return float(len(rows))

    def fail_on_rank(self, rank: int) -> str:
        if self.mesh.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return "ok"


def train_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process run every distributed run must match."""
    trainer = LoraTrainer(device_mesh=DeviceMesh.from_sizes(dp_size=1))
    rows = make_rows()
    losses = [trainer.train_step(rows[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]) for i in range(STEPS)]
    return losses, trainer.lora_state()


def tp_steps(tp_mesh=None) -> dict:
    """Two full-parameter SGD steps of the base model; with `tp_mesh`, attention and MLP are
    tensor-parallel DTensors (column-wise in, row-wise out)."""
    model = build_model(lora=False)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = make_rows()[:GLOBAL_BATCH]
    losses = [step(model, optimizer, rows) for _ in range(2)]
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return {"losses": losses, "q_proj0": weight.detach().clone()}


def torchrun_main(out_path: str) -> None:
    """Every distributed check of one torchrun launch; rank 0 saves what the test asserts."""
    from twinkle.mesh import initialize, rank_seed

    torch.set_num_threads(1)
    dp_mesh = DeviceMesh.from_sizes(dp_size=2)
    initialize(mode="local", global_device_mesh=dp_mesh, seed=7)
    rows = make_rows()
    result = {"rank_seeds": [None, None], "world": dist.get_world_size(), "backend": dist.get_backend()}
    gathered = [None, None]
    dist.all_gather_object(
        gathered,
        {"rank": dp_mesh.rank, "data_rank": dp_mesh.data_rank, "rank_seed": rank_seed(), "draw": torch.rand(1).item()},
    )
    result["ranks"] = gathered
    for name, mesh in (("ddp", dp_mesh), ("fsdp", DeviceMesh.from_sizes(fsdp_size=2))):
        trainer = LoraTrainer(device_mesh=mesh, parallel=name)
        losses = [
            trainer.train_step(mesh.slice_for_data_rank(rows[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]))
            for i in range(STEPS)
        ]
        result[name] = {"losses": losses, "lora": trainer.lora_state()}
    tp_mesh = DeviceMesh.from_sizes(tp_size=2)
    result["tp"] = tp_steps(tp_mesh.to_torch()["tp"])
    result["torch_mesh_dims"] = tp_mesh.to_torch().mesh_dim_names
    if dist.get_rank() == 0:
        torch.save(result, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(sys.argv[1])
