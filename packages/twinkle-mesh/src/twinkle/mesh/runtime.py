"""initialize(): how this process takes part in a job (one process, torchrun, or a Ray driver)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from twinkle.mesh.device_group import DeviceGroup, assign_devices
from twinkle.mesh.device_mesh import DeviceMesh

MODES = ("local", "ray")


@dataclass
class Runtime:
    mode: str
    mesh: DeviceMesh
    groups: list[DeviceGroup] = field(default_factory=list)
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)  # group name -> device indices
    seed: int = 42
    nproc_per_node: int | None = None
    # ray mode: group name -> live remote groups built on it (for get_device_placement)
    remote_groups: dict[str, list] = field(default_factory=dict)
    placements: dict[str, Any] = field(default_factory=dict)  # ray mode: group name -> placement group

    def group(self, name: str) -> DeviceGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(
            f"unknown remote_group {name!r}; initialize() was given groups {[g.name for g in self.groups]}"
        )


_RUNTIME: Runtime | None = None


def require_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ImportError("Twinkle's ray mode needs Ray: pip install 'twinkle-mesh[ray]'") from e
    return ray


def initialize(
    mode: str = "local",
    global_device_mesh: DeviceMesh | None = None,
    groups: list[DeviceGroup] | None = None,
    nproc_per_node: int | None = None,
    seed: int = 42,
    address: str | None = None,
    *,
    lazy_collect: bool = False,  # noqa: ARG001 - twinkle-kit's keyword, see the docstring
    **ray_init_kwargs: Any,
) -> Runtime:
    """Start Twinkle in this process.

    `lazy_collect` (twinkle-kit's name) changes nothing a script reads: a remote call's result is
    collected when the call returns either way (twinkle-kit's lazy handles resolve to the same values).

    local: one process, or one rank of a torchrun job (read from RANK / WORLD_SIZE / LOCAL_RANK);
    joins torch.distributed when the world has more than one rank (gloo on CPU, nccl on CUDA).
    ray: this process drives; components built with `remote_group=` become Ray actor groups on
    `groups`. Joins the cluster at `address`, or starts a local one.
    """
    global _RUNTIME
    if mode not in MODES:
        raise ValueError(
            f"unknown mode {mode!r} for twinkle.mesh.initialize; expected one of {MODES} "
            f"('http' belongs to twinkle-serve)"
        )
    groups = list(groups or [])
    if not all(isinstance(g, DeviceGroup) for g in groups):
        raise ValueError(f"groups must be DeviceGroup objects, got {groups!r}")
    devices = assign_devices(groups)
    if mode == "local":
        if ray_init_kwargs or address:
            raise ValueError(
                f"local mode takes no Ray options, got {sorted(ray_init_kwargs) + (['address'] if address else [])}"
            )
        mesh = _init_local(global_device_mesh)
    else:
        _init_ray(groups, nproc_per_node, address, ray_init_kwargs)
        mesh = global_device_mesh or DeviceMesh.from_sizes(dp_size=1)
    _RUNTIME = Runtime(mode, mesh, groups, devices, seed, nproc_per_node)
    seed_everything(seed)
    return _RUNTIME


def _init_local(mesh: DeviceMesh | None) -> DeviceMesh:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if mesh is None:
        mesh = DeviceMesh.from_sizes(dp_size=world_size)
    mesh.check_world_size(world_size, "torchrun world size (WORLD_SIZE)")
    use_cuda = mesh.resolved_device_type == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10))
    return mesh


def _init_ray(
    groups: list[DeviceGroup], nproc_per_node: int | None, address: str | None, ray_init_kwargs: dict[str, Any]
) -> None:
    ray = require_ray()
    if ray.is_initialized():
        return
    kwargs = dict(ray_init_kwargs)
    kwargs.setdefault("include_dashboard", False)
    if address is None and not os.environ.get("RAY_ADDRESS"):
        # A local cluster: Ray's CPU count is logical, so give every rank's bundle its CPUs even on
        # a small machine (the ranks then share the cores, as torchrun processes would).
        cpus = sum(g.world_size * g.resources_per_rank.get("CPU", 1) for g in groups)
        kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, int(cpus) + 1))
        if nproc_per_node and any(g.device_type == "cuda" for g in groups):
            kwargs.setdefault("num_gpus", nproc_per_node)
    ray.init(address=address, **kwargs)


def shutdown() -> None:
    """Stop every remote group and (ray mode) disconnect from Ray; leave torch.distributed of a
    torchrun job alone (the launcher owns it). Safe to call twice."""
    global _RUNTIME
    rt, _RUNTIME = _RUNTIME, None
    if rt is None or rt.mode != "ray":
        return
    for remotes in list(rt.remote_groups.values()):
        for remote in list(remotes):
            remote.remote_shutdown()
    import ray

    ray.shutdown()


def get_runtime() -> Runtime | None:
    return _RUNTIME


def ray_runtime() -> Runtime:
    """The runtime a Ray group runs under; a remote group exists only after initialize(mode='ray')."""
    if _RUNTIME is None:
        raise RuntimeError("no Twinkle runtime: call twinkle.initialize(mode='ray', ...) before using remote groups")
    return _RUNTIME


def get_global_mesh() -> DeviceMesh:
    """The mesh given to initialize() (or one data-parallel dim over this job's world)."""
    if _RUNTIME is None:
        return DeviceMesh.from_sizes(dp_size=None)
    return _RUNTIME.mesh


def rank_seed(seed: int | None = None) -> int:
    """The per-rank seed: the global seed offset by this process's global rank (for what must differ
    across ranks, e.g. dropout masks or sampling); the global seed keeps weights identical."""
    base = seed if seed is not None else (_RUNTIME.seed if _RUNTIME else 42)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return base + rank


def seed_everything(seed: int) -> None:
    """The global seed: identical on every rank, so every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_generator(device: str = "cpu") -> torch.Generator:
    """A torch.Generator seeded with rank_seed(): random streams that differ per rank."""
    return torch.Generator(device).manual_seed(rank_seed())


def get_device_placement(print_it: bool = True) -> str:
    """Which group runs where: the mode, the mesh, each DeviceGroup's devices and, in ray mode, the
    actors (node, pid, devices) of every remote group built so far. Printed and returned."""
    lines = []
    if _RUNTIME is None:
        lines.append("twinkle: not initialized (one local process)")
    else:
        rt = _RUNTIME
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        lines.append(f"twinkle mode={rt.mode} seed={rt.seed} mesh={rt.mesh!r}")
        if rt.mode == "local":
            lines.append(f"  this process: rank {rt.mesh.rank} of {world}, coords {rt.mesh.coords()}")
        for g in rt.groups:
            lines.append(f"  group {g.name!r}: {g.world_size} x {g.device_type}, devices {list(rt.devices[g.name])}")
            for remote in rt.remote_groups.get(g.name, []):
                lines.extend("    " + line for line in remote.placement_lines())
    text = "\n".join(lines)
    if print_it:
        print(text)
    return text
