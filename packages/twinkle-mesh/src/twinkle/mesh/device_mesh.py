"""DeviceMesh: the parallel topology of one component over its ranks.

Ranks are laid out row-major over (pp, dp, fsdp, cp, tp), tp fastest, so tensor-parallel peers are
neighbours (same node, fastest link) and pipeline stages are furthest apart. Data parallelism is
dp x fsdp: ranks with the same (dp, fsdp) coordinates see the same slice of the global batch.
Expert parallelism does not multiply the world: ep subdivides the data ranks (as in Megatron), so
`ep_size` must divide dp x fsdp.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

MESH_DIMS = ("pp", "dp", "fsdp", "cp", "tp")
DATA_DIMS = ("dp", "fsdp")
ALL_DIMS = (*MESH_DIMS, "ep")


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _env_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _normalize_dims(dims: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(dims, str):
        dims = (dims,)
    out: list[str] = []
    for d in dims:
        expanded = DATA_DIMS if d == "data" else (d,)
        for e in expanded:
            if e not in ALL_DIMS:
                raise ValueError(f"unknown mesh dimension {e!r}; expected some of {ALL_DIMS} or 'data'")
            if e not in out:
                out.append(e)
    if not out:
        raise ValueError("no mesh dimension given")
    if "ep" in out and len(out) > 1:
        raise ValueError(f"'ep' subdivides the data ranks and cannot be combined with other dims: {dims!r}")
    return tuple(out)


class DeviceMesh:
    """Sizes per dimension plus this process's place in them (read live from torch.distributed or
    the torchrun environment, so a mesh pickled to another process answers for that process)."""

    def __init__(self, sizes: dict[str, int], ep_size: int = 1, device_type: str | None = None) -> None:
        for name, size in {**sizes, "ep": ep_size}.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"DeviceMesh {name}_size must be a positive integer, got {size!r}")
        unknown = set(sizes) - set(MESH_DIMS)
        if unknown:
            raise ValueError(f"unknown mesh dimensions {sorted(unknown)}; expected {MESH_DIMS}")
        self.sizes = {d: int(sizes.get(d, 1)) for d in MESH_DIMS}
        self.ep_size = ep_size
        if self.data_world_size % ep_size:
            raise ValueError(
                f"ep_size={ep_size} must divide the data world size dp x fsdp = "
                f"{self.sizes['dp']} x {self.sizes['fsdp']} = {self.data_world_size}"
            )
        self.device_type = device_type
        self._torch_mesh = None
        self._groups: dict[tuple[str, ...], Any] = {}

    @classmethod
    def from_sizes(
        cls,
        dp_size: int | None = 1,
        fsdp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        cp_size: int = 1,
        ep_size: int = 1,
        *,
        world_size: int | None = None,
        device_type: str | None = None,
    ) -> DeviceMesh:
        """`dp_size=None` fills data parallelism with whatever `world_size` (default: this job's world
        size) leaves; a given `world_size` that the sizes do not multiply to is a ValueError."""
        others = {"fsdp": fsdp_size, "tp": tp_size, "pp": pp_size, "cp": cp_size}
        if dp_size is None:
            world = world_size if world_size is not None else _env_world_size()
            rest = math.prod(v for v in others.values() if isinstance(v, int) and v > 0) or 1
            if world % rest:
                raise ValueError(
                    f"cannot infer dp_size: world size {world} is not divisible by "
                    f"fsdp x tp x pp x cp = {rest} (sizes {others})"
                )
            dp_size = world // rest
        mesh = cls({"dp": dp_size, **others}, ep_size=ep_size, device_type=device_type)
        if world_size is not None:
            mesh.check_world_size(world_size)
        return mesh

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_world_size(self) -> int:
        return self.sizes["dp"] * self.sizes["fsdp"]

    def get_size(self, dims: str | Sequence[str]) -> int:
        dims = _normalize_dims(dims)
        return self.ep_size if dims == ("ep",) else math.prod(self.sizes[d] for d in dims)

    def describe_sizes(self) -> str:
        parts = [f"{d}={self.sizes[d]}" for d in MESH_DIMS]
        return " x ".join(parts) + f" = {self.world_size}" + (f" (ep={self.ep_size})" if self.ep_size > 1 else "")

    def check_world_size(self, world_size: int, where: str = "world size") -> None:
        if world_size != self.world_size:
            raise ValueError(f"DeviceMesh sizes {self.describe_sizes()} do not match the {where} {world_size}")

    # -- this rank's coordinates ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return _current_rank()

    def coords(self, rank: int | None = None) -> dict[str, int]:
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this DeviceMesh ({self.describe_sizes()})")
        out = dict(zip(MESH_DIMS, (int(i) for i in np.unravel_index(rank, self.shape))))
        out["ep"] = self._data_rank_of(out) % self.ep_size
        return out

    def _data_rank_of(self, coords: dict[str, int]) -> int:
        return coords["dp"] * self.sizes["fsdp"] + coords["fsdp"]

    def get_rank(self, dims: str | Sequence[str], rank: int | None = None) -> int:
        """Index of `rank` (default: this process) inside its group over `dims`."""
        dims = _normalize_dims(dims)
        c = self.coords(rank)
        if dims == ("ep",):
            return c["ep"]
        return int(np.ravel_multi_index([c[d] for d in dims], [self.sizes[d] for d in dims]))

    @property
    def data_rank(self) -> int:
        return self.get_rank(DATA_DIMS)

    # -- groups --------------------------------------------------------------------------------
    def all_group_ranks(self, dims: str | Sequence[str]) -> list[list[int]]:
        """Every group over `dims` as lists of global ranks, in a fixed order (the same on all ranks)."""
        dims = _normalize_dims(dims)
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            if dims == ("ep",):
                key = (*(c[d] for d in MESH_DIMS if d not in DATA_DIMS), self._data_rank_of(c) // self.ep_size)
            else:
                key = tuple(c[d] for d in MESH_DIMS if d not in dims)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def get_group_ranks(self, dims: str | Sequence[str], rank: int | None = None) -> list[int]:
        rank = self.rank if rank is None else rank
        return next(g for g in self.all_group_ranks(dims) if rank in g)

    def get_group(self, dims: str | Sequence[str]) -> dist.ProcessGroup | None:
        """The torch.distributed process group of this rank over `dims` (e.g. 'dp', ('dp', 'fsdp'),
        'data'). Collective the first time: every rank must ask for the same dims in the same order."""
        dims = _normalize_dims(dims)
        if dims not in self._groups:
            _ensure_process_group(self)
            if self.get_size(dims) == self.world_size == dist.get_world_size():
                self._groups[dims] = dist.group.WORLD
            else:
                mine = None
                for ranks in self.all_group_ranks(dims):  # new_group is collective over the world
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
                self._groups[dims] = mine
        return self._groups[dims]

    def to_torch(self) -> TorchDeviceMesh:
        """This mesh as a `torch.distributed.DeviceMesh` with dims (pp, dp, fsdp, cp, tp); slice it
        as usual (`mesh.to_torch()["fsdp"]`, `["dp", "fsdp"]` for HSDP)."""
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            _ensure_process_group(self)
            self._torch_mesh = init_device_mesh(self.resolved_device_type, self.shape, mesh_dim_names=MESH_DIMS)
        return self._torch_mesh

    @property
    def resolved_device_type(self) -> str:
        return self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    # -- data ----------------------------------------------------------------------------------
    def slice_for_data_rank(self, global_items: Sequence, data_rank: int | None = None) -> list:
        """The contiguous share of a global batch for `data_rank` (default: this rank's). An uneven
        batch gives the first `len % data_world_size` data ranks one item more."""
        data_rank = self.data_rank if data_rank is None else data_rank
        if not 0 <= data_rank < self.data_world_size:
            raise ValueError(f"data_rank {data_rank} is outside the data world size {self.data_world_size}")
        start, stop = split_bounds(len(global_items), self.data_world_size, data_rank)
        return list(global_items[start:stop])

    # -- value semantics -----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # Process groups and torch meshes belong to one process; the receiver rebuilds its own.
        state = dict(self.__dict__)
        state["_torch_mesh"], state["_groups"] = None, {}
        return state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and (self.sizes, self.ep_size) == (other.sizes, other.ep_size)

    def __hash__(self) -> int:
        return hash((self.shape, self.ep_size))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}_size={s}" for d, s in self.sizes.items() if s > 1) or "dp_size=1"
        return f"DeviceMesh({sizes}{f', ep_size={self.ep_size}' if self.ep_size > 1 else ''})"


def split_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are cut into `parts` contiguous near-equal parts."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _ensure_process_group(mesh: DeviceMesh) -> None:
    """Groups need torch.distributed; a one-rank mesh in a plain process gets a private one-rank group."""
    if dist.is_initialized():
        mesh.check_world_size(dist.get_world_size(), "torch.distributed world size")
        return
    if mesh.world_size != 1:
        raise RuntimeError(
            f"DeviceMesh {mesh.describe_sizes()} needs torch.distributed: launch with "
            f"torchrun (or a Ray remote group) and call twinkle.mesh.initialize() first"
        )
    backend = "nccl" if mesh.resolved_device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
