"""Data-parallel wrapping from the DeviceMesh: DDP or FSDP2 over the data ranks.

In one process (or a mesh whose data dims have size 1) the model runs unwrapped. Wrapping happens
once the trainable parameters are final (the first forward), because both DDP and FSDP2 fix the
parameter set when they wrap.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "fsdp2")


def data_parallel_size(mesh) -> int:
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return mesh.data_world_size


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (each becomes its own FSDP unit)."""
    names = getattr(model, "_no_split_modules", None) or []
    for m in model.modules():
        names = names or getattr(m, "_no_split_modules", None) or []
    return [m for m in model.modules() if type(m).__name__ in set(names)]


def wrap(module: torch.nn.Module, strategy: str, mesh, hf_model: torch.nn.Module) -> torch.nn.Module:
    if data_parallel_size(mesh) == 1:
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if mesh.resolved_device_type == "cuda" else None
        return DistributedDataParallel(module, process_group=mesh.get_group("data"), device_ids=device_ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        torch_mesh = mesh.to_torch()["fsdp"] if mesh.get_size("dp") == 1 else mesh.to_torch()["dp", "fsdp"]
        for layer in _decoder_layers(hf_model):
            fully_shard(layer, mesh=torch_mesh)
        fully_shard(module, mesh=torch_mesh)
        return module
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def no_sync(wrapped: torch.nn.Module, accumulate: bool):
    """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation."""
    if accumulate and hasattr(wrapped, "no_sync"):
        return wrapped.no_sync()
    if accumulate and hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        return _restore_sync(wrapped)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restore_sync(wrapped):
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded (DTensor) one; collective for sharded ones."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
