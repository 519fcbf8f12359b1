"""Tensor parallelism for transformers decoders with torch's DTensor `parallelize_module` plans.

The Megatron layout, as torchtitan applies it to Llama:
- attention: q/k/v_proj column-parallel (each rank computes its own heads), o_proj row-parallel;
- MLP: gate/up_proj column-parallel, down_proj row-parallel;
- so one all-reduce per block half in the forward (after the row-parallel layer) and one in the
  backward (the input gradient of the column-parallel layers).
The column-parallel outputs stay local tensors (`use_local_output`), so the attention code sees a
plain [B, T, heads/tp * head_dim] tensor: transformers reshapes it with `view(..., -1, head_dim)`,
which yields this rank's heads; `num_key_value_groups` (a ratio) is unchanged when both head
counts divide by tp. Qwen3's per-head q_norm/k_norm then normalise local heads: their weight is a
replicated DTensor and their input a heads-sharded one (torch's SequenceParallel on the heads
dim), so the weight gradient is summed over the tp ranks.

LoRA (peft) keeps the layout of its base layer: under a column-parallel base, lora_A is replicated
and lora_B column-parallel (its output adds to this rank's output columns); under a row-parallel
base, lora_A is row-parallel (it reads this rank's input columns, its output is all-reduced) and
lora_B replicated.

Every other parameter (embeddings, norms, lm_head) becomes a replicated DTensor on the tp mesh, so
the model holds DTensors only: optimizers (foreach), gradient-norm clipping and FSDP2 on the data
dims then treat every parameter alike. Tied weights stay tied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from twinkle.model.structure import TP_LAYOUT, describe

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle
    from transformers import PretrainedConfig

COLWISE = tuple(leaf for leaf, how in TP_LAYOUT.items() if how == "col")
ROWWISE = tuple(leaf for leaf, how in TP_LAYOUT.items() if how == "row")
HEAD_NORMS = ("q_norm", "k_norm")
_INSTEAD = "train it with tp_size=1 (fsdp_size shards its memory over the ranks instead)"
_WHY = {
    "fused": "a fused projection (its parts would have to be split separately)",
    "low_rank": "an MLA low-rank projection (the latent and its norm are not planned)",
    "unknown": "a projection whose tp layout is not known",
    "experts": "3-D expert weights (expert parallelism is not planned on the torch backend)",
}


def check_shardable(model: torch.nn.Module) -> None:
    """Refuse at construction, by module name, what the column/row plan cannot split."""
    structure = describe(model)
    for part in structure.parts:
        if part.tp in _WHY:
            raise ValueError(
                f"tp_size > 1 cannot shard {part.name} ({structure.model_type}): it is {_WHY[part.tp]}; {_INSTEAD}"
            )
    if structure.head_params:
        raise ValueError(
            f"tp_size > 1 cannot shard {structure.head_params[0]} ({structure.model_type}): per-head attention "
            f"parameters (sinks) are not split with the heads; {_INSTEAD}"
        )
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // getattr(
        config, "num_attention_heads", 1
    )
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in HEAD_NORMS and weight is not None and weight.shape[-1] != head_dim:
            raise ValueError(
                f"tp_size > 1 cannot shard {name} ({structure.model_type}): it normalises across all heads "
                f"(width {weight.shape[-1]}, head_dim {head_dim}), so its statistics span the tp ranks; {_INSTEAD}"
            )
    if structure.unplaced:
        raise ValueError(
            f"tp_size > 1 cannot shard {structure.unplaced[0]} ({structure.model_type}): a Linear with no known role; "
            f"{_INSTEAD}"
        )


def check_divisible(config: PretrainedConfig, tp: int, model: torch.nn.Module | None = None) -> None:
    """Heads and MLP width must split evenly over the tp ranks, and every weight have a plan."""
    if model is not None:
        check_shardable(model)
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    bad = {k: v for k, v in sizes.items() if v is None or v % tp}
    if bad:
        raise ValueError(
            f"tp_size={tp} must divide {', '.join(f'{k}={v}' for k, v in bad.items())} of the model config"
        )


def _role(name: str) -> tuple[str | None, str | None]:
    """(projection kind 'col'|'row', part 'base'|'lora_A'|'lora_B') of a Linear module by its name."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        kind = "col" if parts[i] in COLWISE else "row" if parts[i] in ROWWISE else None
        if kind is None:
            continue
        rest = parts[i + 1 :]
        if not rest or rest == ["base_layer"]:
            return kind, "base"
        if rest[0] in ("lora_A", "lora_B") and len(rest) == 2:
            return kind, rest[0]
        return None, None
    return None, None


def _style(module: torch.nn.Module, name: str) -> ParallelStyle | None:
    if name.rsplit(".", 1)[-1] in HEAD_NORMS:
        return SequenceParallel(sequence_dim=2, use_local_output=True)  # input [B, T, heads, head_dim]
    if "lora_magnitude_vector" in name.split(".")[:-1]:  # an adapter's entry in peft's (always present) dict
        raise ValueError(
            "tp_size > 1 does not support DoRA (use_dora=True): its magnitude needs the "
            "norm of the whole base weight; train it without tp"
        )
    if hasattr(module, "base_layer"):
        return None  # a peft wrapper: its base_layer and lora_A/B are placed one by one
    kind, part = _role(name)
    if kind is not None and not isinstance(module, torch.nn.Linear):
        raise ValueError(
            f"tp_size > 1 splits the attention and MLP projections as torch.nn.Linear, but {name} "
            f"is a {type(module).__name__}"
        )
    if (kind, part) in (("col", "base"), ("col", "lora_B")):
        return ColwiseParallel()
    if (kind, part) in (("row", "base"), ("row", "lora_A")):
        return RowwiseParallel()
    return None  # lora_A of a column-parallel layer, lora_B of a row-parallel one: replicated


def _is_distributed(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def parallelize(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Apply the tp plan to every module not yet distributed (so adapters added later are placed
    the next time), then replicate what remains. Idempotent."""
    plan = {}
    for name, module in model.named_modules():
        style = None if _is_distributed(module) else _style(module, name)
        if style is not None:
            plan[name] = style
    if plan:
        parallelize_module(model, tp_mesh, plan)
    _replicate_rest(model, tp_mesh)
    return model


def _replicate_rest(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    replaced: dict[int, torch.nn.Parameter] = {}  # by identity, so tied weights stay one parameter

    def partition(module: torch.nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            if id(p) not in replaced:
                replaced[id(p)] = torch.nn.Parameter(
                    distribute_tensor(p.data, mesh, [Replicate()]), requires_grad=p.requires_grad
                )
            module.register_parameter(pname, replaced[id(p)])

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not all(isinstance(p, DTensor) for p in own):
            partition(module, tp_mesh)  # this module's own parameters only, not its children's
            # torch annotates input_fn / output_fn as returning None, and uses what they return
            distribute_module(
                module,
                tp_mesh,
                lambda *_: None,
                input_fn=_inputs_replicated,  # ty: ignore[invalid-argument-type]
                output_fn=_outputs_local,  # ty: ignore[invalid-argument-type]
            )


def _inputs_replicated(_module: torch.nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _outputs_local(_module: torch.nn.Module, outputs: object, _mesh: DeviceMesh) -> object:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs
