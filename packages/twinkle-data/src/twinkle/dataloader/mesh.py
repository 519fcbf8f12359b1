"""Which slice of each global batch this process gets: from a DeviceMesh, or any object that has
``data_rank`` and ``data_world_size``, or the global mesh set by ``twinkle.initialize`` (local /
torchrun mode; in ray mode the driver gets whole global batches)."""

from __future__ import annotations

from typing import Protocol


class DataRanks(Protocol):
    """What a loader reads of a mesh (twinkle.mesh.DeviceMesh has it)."""

    @property
    def data_rank(self) -> int: ...

    @property
    def data_world_size(self) -> int: ...


class _SingleRank:
    data_rank = 0
    data_world_size = 1


class _WholeBatches:
    """The ray driver's view of a model mesh: whole global batches, sized in multiples of its data ranks."""

    data_rank = 0

    def __init__(self, data_world_size: int) -> None:
        self.data_world_size = data_world_size

    def slice_for_data_rank(self, rows: list) -> list:
        return rows


def _ray_driver() -> bool:
    try:
        from twinkle.mesh.runtime import get_runtime
    except ImportError:
        return False
    runtime = get_runtime()
    return runtime is not None and runtime.mode == "ray"


def check_remote_group(name: str | None) -> None:
    """A loader's `remote_group` (twinkle-kit's keyword) must name a DeviceGroup of the running ray-mode
    runtime; the driver reads the data either way (see resolve_mesh)."""
    if name is None:
        return
    from twinkle.mesh.runtime import get_runtime

    runtime = get_runtime()
    groups = [g.name for g in runtime.groups] if runtime is not None else []
    if name not in groups:
        raise ValueError(f"remote_group {name!r} is not a DeviceGroup of twinkle.initialize(mode='ray', ...): {groups}")


def resolve_mesh(device_mesh: DataRanks | None) -> DataRanks:
    if device_mesh is not None:
        for attr in ("data_rank", "data_world_size"):
            if not hasattr(device_mesh, attr):
                raise TypeError(f"device_mesh {device_mesh!r} has no {attr!r}; pass a twinkle.mesh.DeviceMesh")
        if _ray_driver():  # the model's mesh (twinkle-kit passes it): its ranks are actors, not this driver
            return _WholeBatches(device_mesh.data_world_size)
        return device_mesh
    if _ray_driver():
        # The Ray driver is no data rank: it feeds whole global batches and the remote groups
        # split them across their ranks (remote_method dispatch='slice').
        return _SingleRank()
    try:
        from twinkle.mesh import get_global_mesh
    except ImportError:
        return _SingleRank()
    return get_global_mesh() or _SingleRank()


def slice_for_rank(mesh: DataRanks, rows: list) -> list:
    """This data rank's rows of a global batch: the mesh decides where it can; otherwise contiguous
    equal chunks in rank order."""
    split = getattr(mesh, "slice_for_data_rank", None)
    if split is not None:
        return list(split(rows))
    world, rank = mesh.data_world_size, mesh.data_rank
    per_rank = len(rows) // world
    return rows[rank * per_rank : (rank + 1) * per_rank]
