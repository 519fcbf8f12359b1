"""twinkle-kit's `TransformersModel(strategy='native_fsdp', fsdp_config={...})` on our strategies.

twinkle-kit's 'native_fsdp' is torch's FSDP2 (`fully_shard`), ours under the name 'fsdp2' (in one
process nothing is wrapped either way). Of `fsdp_config` its native strategy reads
`reshard_after_forward` (FSDP2's default True is ours; False is refused), `manual_prefetch` and
`expert_parallel`, the last two only where expert parallelism is on: on when `expert_parallel` is given,
its `enabled` (default True) holds and its `ep_size` (or the mesh's ep) is above 1. Expert parallelism is
not implemented by TransformersModel, so that case is refused by name; with it off those keys change
nothing there, as here. Any other key is refused by name (twinkle-kit's native strategy ignores them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twinkle.mesh import DeviceMesh

KIT_STRATEGIES = {"native_fsdp": "fsdp2"}
FSDP_KEYS = ("reshard_after_forward", "manual_prefetch", "expert_parallel")
EXPERT_PARALLEL_KEYS = ("enabled", "router_dtype", "keep_router_logits", "ignore_shared_experts", "ep_size")


def resolve_kit_strategy(
    strategy: str | None, fsdp_config: dict[str, Any] | None, mesh: DeviceMesh | None
) -> str | None:
    """Our strategy name for twinkle-kit's (`'native_fsdp'` -> `'fsdp2'`; ours pass through), after
    checking `fsdp_config`, which only a native FSDP strategy takes."""
    ours = KIT_STRATEGIES.get(strategy, strategy) if strategy is not None else None
    if fsdp_config is None:
        return ours
    if not isinstance(fsdp_config, dict):
        raise TypeError(f"fsdp_config must be a dict, got {type(fsdp_config).__name__}")
    if fsdp_config and strategy != "native_fsdp":
        raise ValueError(
            f"fsdp_config {sorted(fsdp_config)} is twinkle-kit's native FSDP configuration: pass "
            f"strategy='native_fsdp' with it (strategy={strategy!r})"
        )
    unknown = sorted(set(fsdp_config) - set(FSDP_KEYS))
    if unknown:
        raise ValueError(f"fsdp_config {unknown} cannot be honoured: the keys taken are {list(FSDP_KEYS)}")
    if fsdp_config.get("reshard_after_forward", True) is not True:
        raise ValueError(
            "fsdp_config['reshard_after_forward']=False cannot be honoured: FSDP2 here reshards after "
            "every forward (its default, True)"
        )
    _check_expert_parallel(fsdp_config.get("expert_parallel"), mesh)
    return ours


def _check_expert_parallel(config: dict[str, Any] | None, mesh: DeviceMesh | None) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise TypeError(f"fsdp_config['expert_parallel'] must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(EXPERT_PARALLEL_KEYS))
    if unknown:
        raise ValueError(
            f"fsdp_config['expert_parallel'] {unknown} cannot be honoured: the keys taken are "
            f"{list(EXPERT_PARALLEL_KEYS)}"
        )
    ep_size = config.get("ep_size") or (mesh.get_size("ep") if mesh is not None else 1)
    if config.get("enabled", True) and ep_size > 1:
        raise NotImplementedError(
            f"fsdp_config['expert_parallel'] enabled with ep_size={ep_size}: TransformersModel does not "
            "implement expert parallelism (each rank holds every expert); set 'enabled': False or ep_size 1, "
            "or use MegatronModel (twinkle-model[megatron]) for ep"
        )
