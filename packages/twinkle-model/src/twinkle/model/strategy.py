"""How a TransformersModel uses each DeviceMesh dimension, and the wrapping that does it.

Mesh dimensions (sizes from the DeviceMesh, ranks laid out (pp, dp, fsdp, cp, tp), tp fastest):
- dp: data parallel, replicated model. Each dp rank trains on its slice of the global batch;
  gradients are averaged (DDP; with tp > 1, FSDP2 in replicate mode, since DDP cannot hold DTensors).
- fsdp: data parallel, sharded model (FSDP2 `fully_shard`). `fsdp_size > 1` selects FSDP2 by
  itself; dp x fsdp is HSDP (replicate over dp, shard over fsdp). `strategy='ddp'` with
  fsdp > 1 is refused (DDP cannot shard).
- tp: tensor parallel with torch's DTensor `parallelize_module` plans (twinkle.model.tensor_parallel):
  tp peers see the same data and each holds 1/tp of every attention and MLP projection.
- cp: context parallelism (twinkle.model.context_parallel): cp peers see the same rows, each runs
  a contiguous part of every sequence. Combines with dp (ranks then reduce over dp x cp, the
  "gradient group"); with fsdp or tp it is refused.
- pp, ep: not implemented by TransformersModel, refused at construction (the extra ranks would
  only repeat the work); MegatronModel implements them.
`strategy=None` (the default) picks FSDP2 when fsdp > 1, else DDP.

In one process (or a mesh whose dims all have size 1) the model runs unwrapped. Wrapping happens
once the trainable parameters are final (the first forward), because DDP, FSDP2 and the tp plan
fix the parameter set when they wrap.

A data-parallel step must equal the one-process step on the same global batch. Two things make it so:
- the loss: a 'mean' loss divides by the loss units of the *global* micro-batch, not of this rank's
  share. The loss class says what its units are (`Loss.units`: loss tokens, or (chosen, rejected)
  pairs for the preference losses) and counts them from the batch alone. DDP/FSDP2 average gradients
  over the data ranks, so each rank backpropagates `W * n_rank / n_global * loss_rank`
  (`data_parallel_loss`); MultiLoraModel, whose adapters come and go (DDP wraps a fixed parameter
  set), scales its 'mean' losses by `n_rank / n_global` before the forward (`data_parallel_weights`)
  and sums gradients at step time (`sum_gradients`; twinkle.model.multi_lora.data_parallel);
- FSDP2 and tp swap every parameter for a DTensor: optimizers and per-adapter parameter lists
  made before the wrap are pointed at the new ones (`rebind_parameters`), and the gradient norm is
  taken over the full (unsharded) gradients (`clip_grad_norm`).
What a rank recorded of its share (loss, tokens, the loss's metrics) becomes the global pass's record
in one place (`merge_records`), for every engine that splits a pass: data ranks, or a long pass run
as pieces.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from twinkle.metric import ForwardRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from twinkle.loss.base import Loss, LossContext
    from twinkle.mesh import DeviceMesh
    from twinkle.model.state import AdapterState

_MaybeTensor = TypeVar("_MaybeTensor", torch.Tensor, None)

STRATEGIES = ("ddp", "fsdp2")
# torch DistributedDataParallel's keyword arguments a `ddp_config` may set (twinkle-kit passes its dict to
# accelerate's DistributedDataParallelKwargs; its communication hooks are not offered here)
DDP_OPTIONS = (
    "find_unused_parameters",
    "broadcast_buffers",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
)
UNIMPLEMENTED_DIMS = {"pp": "pipeline parallelism", "ep": "expert parallelism"}


def resolve_strategy(strategy: str | None, mesh: DeviceMesh | None) -> str:
    """The data-parallel strategy for this mesh; refuses dims TransformersModel does not implement."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES} (or None: from the mesh)")
    if mesh is None:
        return strategy or "ddp"
    cp = mesh.get_size("cp")
    if cp > 1 and (mesh.get_size("fsdp") > 1 or mesh.get_size("tp") > 1 or strategy == "fsdp2"):
        raise ValueError(
            f"TransformersModel implements context parallelism (cp_size={cp}) with dp (DDP) only; "
            f"{mesh!r} also asks for fsdp/tp or strategy='fsdp2': give those ranks to dp, or use cp_size=1"
        )
    for dim, what in UNIMPLEMENTED_DIMS.items():
        if mesh.get_size(dim) > 1:
            raise ValueError(
                f"TransformersModel does not implement {what} ({dim}_size={mesh.get_size(dim)} in "
                f"{mesh!r}): its ranks would only repeat the work. Use MegatronModel "
                f"(twinkle-model[megatron]) for {dim}, or give those ranks to dp/fsdp/tp"
            )
    fsdp = mesh.get_size("fsdp")
    if strategy == "ddp" and fsdp > 1:
        raise ValueError(
            f"strategy='ddp' replicates the model, but {mesh!r} has fsdp_size={fsdp}, which shards "
            f"it: pass strategy='fsdp2' (or no strategy), or use dp_size for replicas"
        )
    return strategy or ("fsdp2" if fsdp > 1 else "ddp")


def check_ddp_config(ddp_config: dict[str, Any] | None, strategy: str, mesh: DeviceMesh | None) -> dict:
    """The DDP keyword arguments of a `ddp_config`; a key DDP does not take here, or a mesh whose model is
    not wrapped in DDP (FSDP2, tensor parallelism), is refused by name. In one process nothing is wrapped."""
    if ddp_config is None:
        return {}
    if not isinstance(ddp_config, dict):
        raise TypeError(
            f"ddp_config must be a dict of DistributedDataParallel arguments, got {type(ddp_config).__name__}"
        )
    unknown = sorted(set(ddp_config) - set(DDP_OPTIONS))
    if unknown:
        raise ValueError(f"ddp_config {unknown} cannot be honoured: the DDP options taken are {list(DDP_OPTIONS)}")
    if ddp_config and mesh is not None and (strategy == "fsdp2" or tensor_parallel_size(mesh) > 1):
        raise ValueError(
            f"ddp_config {sorted(ddp_config)}: {mesh!r} with strategy={strategy!r} wraps the model in FSDP2, not DDP"
        )
    return dict(ddp_config)


def tensor_parallel_size(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh.get_size("tp")


def check_tensor_parallel(mesh: DeviceMesh | None, model: PreTrainedModel) -> None:
    if tensor_parallel_size(mesh) > 1:
        from twinkle.model.tensor_parallel import check_divisible

        check_divisible(model.config, tensor_parallel_size(mesh), model)


def shards_on_wrap(strategy: str, mesh: DeviceMesh | None) -> bool:
    """Whether wrapping hands the model to FSDP2 (fsdp2, or any data parallelism with tp > 1):
    then the parameter set is final, and adapters cannot be added after the first forward."""
    return data_parallel_size(mesh) > 1 and (strategy == "fsdp2" or tensor_parallel_size(mesh) > 1)


def gradient_dims(mesh: DeviceMesh) -> str | tuple[str, ...]:
    """The ranks whose losses make one global batch and whose gradients are averaged: the data
    ranks, and with context parallelism also the cp peers (each holds part of every sequence)."""
    return "data" if mesh.get_size("cp") == 1 else ("dp", "fsdp", "cp")


def data_parallel_size(mesh: DeviceMesh | None) -> int:
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return mesh.get_size(gradient_dims(mesh))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (each becomes its own FSDP unit)."""
    names: list[str] = []
    for m in model.modules():
        names = names or list(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in set(names)]


def _fsdp_mesh(mesh: DeviceMesh) -> torch.distributed.device_mesh.DeviceMesh:
    """fsdp alone shards; dp x fsdp is HSDP (replicate over dp, shard over fsdp)."""
    torch_mesh = mesh.to_torch()
    return torch_mesh["fsdp"] if mesh.get_size("dp") == 1 else torch_mesh["dp", "fsdp"]


def wrap(
    module: torch.nn.Module,
    strategy: str,
    mesh: DeviceMesh,
    hf_model: torch.nn.Module,
    ddp_options: dict | None = None,
) -> torch.nn.Module:
    """`ddp_options`: DistributedDataParallel's keyword arguments (check_ddp_config), where it wraps."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if tensor_parallel_size(mesh) > 1:
        from twinkle.model.tensor_parallel import parallelize

        parallelize(module, mesh.to_torch()["tp"])
    if data_parallel_size(mesh) == 1:
        return module
    if not shards_on_wrap(strategy, mesh):
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if mesh.resolved_device_type == "cuda" else None
        group = mesh.get_group(gradient_dims(mesh))
        return DistributedDataParallel(module, process_group=group, device_ids=device_ids, **(ddp_options or {}))
    from torch.distributed.fsdp import fully_shard

    torch_mesh = _fsdp_mesh(mesh)
    for layer in _decoder_layers(hf_model):
        fully_shard(layer, mesh=torch_mesh)
    fully_shard(module, mesh=torch_mesh)
    return module


def rebind_parameters(module: torch.nn.Module, states: Iterable[AdapterState]) -> None:
    """Point each state's parameter list and optimizer at the module's current parameters (by
    name). FSDP2 replaces parameters with sharded DTensors; DDP keeps them (then this is a no-op).
    Optimizer state already built for the old tensors cannot follow a sharding: refuse it."""
    current = dict(module.named_parameters())
    for state in states:
        named = state.named_params()
        swapped = {id(p): current[n] for n, p in named if n in current and current[n] is not p}
        if not swapped:
            continue
        state.params = [current.get(n, p) for n, p in named]
        optimizer = state.optimizer
        if optimizer is None:
            continue
        if any(id(p) in swapped for p in optimizer.state):
            raise RuntimeError(
                f"adapter {state.name!r} has optimizer state from before the FSDP2 wrap; "
                f"load checkpoints / resume after the first forward_backward"
            )
        for group in optimizer.param_groups:
            group["params"] = [swapped.get(id(p), p) for p in group["params"]]
            if group.get("fused"):  # torch's fused CPU kernels have no DTensor sharding rule
                group["fused"], group["foreach"] = False, True


def mean_units(loss: Loss, ctx: LossContext) -> torch.Tensor:
    """What a 'mean' loss divides by for this context's rows (`Loss.units`), as a float64 scalar."""
    return torch.tensor(loss.units(ctx.targets_B_T, ctx.fields), dtype=torch.float64)


def data_parallel_loss(
    loss: torch.Tensor, loss_fn: Loss, ctx: LossContext, mesh: DeviceMesh | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank backpropagates, the loss of the global micro-batch).

    One all-reduce of two numbers per micro-batch (also on no-sync micro-batches: it is not the
    gradient sync). A non-finite loss on any rank makes the global value non-finite on all ranks,
    and it is returned as both, so every rank skips the same step."""
    world = data_parallel_size(mesh)
    if world == 1 or mesh is None:
        return loss, loss
    if loss_fn.reduction == "sum":  # global sum: each rank's gradient counts fully
        units = torch.tensor(1.0, dtype=torch.float64)
        packed = torch.stack([torch.tensor(0.0, dtype=torch.float64), loss.detach().double().cpu()])
    else:
        units = mean_units(loss_fn, ctx)
        packed = torch.stack([units, loss.detach().double().cpu() * units])
    comm_device = torch.device("cuda", torch.cuda.current_device()) if mesh.resolved_device_type == "cuda" else "cpu"
    packed = packed.to(comm_device)
    dist.all_reduce(packed, group=mesh.get_group(gradient_dims(mesh)))
    total_units, total = packed.cpu().tolist()
    if loss_fn.reduction == "sum":
        weight, value = 1.0, total
    else:
        weight = float(units) / total_units if total_units > 0 else 1.0 / world
        value = total / total_units if total_units > 0 else total / world
    reported = torch.tensor(value, dtype=loss.dtype, device=loss.device)
    if not torch.isfinite(reported):
        return reported, reported
    return loss * (world * weight), reported


def data_parallel_weights(units: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Each pass's share of the data-parallel batch: this rank's loss units (`Loss.units`) over all
    ranks' (one all-reduce for every pass at once, before the forward). A rank that scales its 'mean'
    loss by its share before backward and has its gradients summed (`sum_gradients`) gets what
    `data_parallel_loss` plus DDP's average give: the global batch's gradient. For MultiLoraModel,
    whose fused pass holds several tenants' losses and cannot all-reduce once per loss inside it."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1 or not units:
        return [1.0] * len(units)
    mine = torch.tensor([float(u) for u in units], dtype=torch.float64)
    total = mine.clone()
    dist.all_reduce(total, group=group)
    return [float(m) / float(t) if t > 0 else 1.0 / world for m, t in zip(mine.tolist(), total.tolist())]


def sum_gradients(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the data ranks' gradients into every rank (flattened, one all-reduce): DDP's gradient sync,
    taken at step time for an engine whose parameter set changes between steps (adapters added and
    removed), which DDP cannot wrap once. Ranks without any gradient take part with zeros."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1 or not params:
        return
    device = params[0].device
    has = torch.tensor([float(any(p.grad is not None for p in params))], device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    if not has.item():
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.grad = chunk.view_as(p).clone()


def data_parallel_sums(mesh: DeviceMesh | None, counts: Sequence[int]) -> tuple[int, ...]:
    """Counts (loss tokens, correct tokens) summed over the ranks of the global micro-batch."""
    if data_parallel_size(mesh) == 1 or mesh is None:
        return tuple(counts)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.resolved_device_type == "cuda" else "cpu"
    packed = torch.tensor(list(counts), dtype=torch.int64, device=device)
    dist.all_reduce(packed, group=mesh.get_group(gradient_dims(mesh)))
    return tuple(int(c) for c in packed.tolist())


@dataclass
class RankRecord:
    """What one part of a pass recorded (a data rank's share of the rows, or a piece of a long pass)."""

    record: ForwardRecord
    rows: int
    units: float  # its loss units (`Loss.units`)


def merge_records(parts: Sequence[RankRecord], loss: Loss) -> ForwardRecord:
    """The record one process would have made of the whole pass: a summed loss adds up over the parts,
    a mean one is averaged over the loss's units (tokens, or pairs); each of the loss's metrics combines
    as the loss says (`Loss.metric_merge`: 'sum', 'row_mean', or 'unit_mean'). Parts without a loss
    token do not count; a non-finite part makes the whole pass non-finite."""
    records = [p.record for p in parts]
    scored = [p for p in parts if p.record.loss_tokens]
    finite = bool(scored) and all(p.record.finite for p in scored)

    def mean(values: list[tuple[float, float]]) -> float:  # (value, weight); unweighted when no weight
        total = sum(w for _, w in values)
        return sum(v * w for v, w in values) / total if total else sum(v for v, _ in values) / len(values)

    if not finite:
        value = next((p.record.loss for p in scored if not p.record.finite), math.nan)
    elif loss.reduction == "sum":
        value = sum(p.record.loss or 0.0 for p in scored)
    else:
        value = mean([(p.record.loss or 0.0, p.units) for p in scored])
    extras = {}
    for key in scored[0].record.extras if finite else {}:
        how = loss.metric_merge(key)
        values = [(p.record.extras.get(key, 0.0), p) for p in scored]
        if how == "sum":
            extras[key] = sum(v for v, _ in values)
        else:
            extras[key] = mean([(v, p.rows if how == "row_mean" else p.units) for v, p in values])
    return ForwardRecord(
        loss=value,
        loss_tokens=sum(r.loss_tokens for r in records),
        input_tokens=sum(r.input_tokens for r in records),
        correct_tokens=sum(r.correct_tokens for r in records),
        seconds=max(r.seconds for r in records),
        flops=sum(r.flops for r in records),
        finite=finite,
        extras=extras,
    )


def no_sync(wrapped: torch.nn.Module, accumulate: bool) -> contextlib.AbstractContextManager[None]:
    """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation."""
    # DDP's no_sync / FSDP2's set_requires_gradient_sync: looked up, as nn.Module types neither
    ddp_no_sync, fsdp_sync = getattr(wrapped, "no_sync", None), getattr(wrapped, "set_requires_gradient_sync", None)
    if accumulate and ddp_no_sync is not None:
        return ddp_no_sync()
    if accumulate and fsdp_sync is not None:
        fsdp_sync(False)
        return _restore_sync(fsdp_sync)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restore_sync(set_sync: Callable[[bool], None]) -> Generator[None]:
    try:
        yield
    finally:
        set_sync(True)


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Global gradient norm (over every shard when gradients are DTensors), then clip in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = full_tensor(torch.nn.utils.get_total_norm(grads, norm_type))
    torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return float(total)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded (DTensor) one; collective for sharded ones."""
    gather = getattr(t, "full_tensor", None)  # DTensor's
    return gather() if gather is not None else t


def local_tensor(t: _MaybeTensor) -> _MaybeTensor:
    """This rank's piece of a DTensor (all of it when replicated, as tp keeps the lm_head); gradients
    flow back with the same placement. Plain tensors pass through."""
    to_local = getattr(t, "to_local", None)  # DTensor's
    return to_local() if to_local is not None else t


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
