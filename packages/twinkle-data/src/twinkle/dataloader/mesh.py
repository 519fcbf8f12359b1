"""Which slice of each global batch this process gets: from a DeviceMesh, or any object that has
``data_rank`` and ``data_world_size``, or the global mesh set by ``twinkle.initialize`` (local /
torchrun mode; in ray mode the driver gets whole global batches)."""

from __future__ import annotations


class _SingleRank:
    data_rank = 0
    data_world_size = 1


def resolve_mesh(device_mesh):
    if device_mesh is not None:
        for attr in ("data_rank", "data_world_size"):
            if not hasattr(device_mesh, attr):
                raise TypeError(f"device_mesh {device_mesh!r} has no {attr!r}; pass a twinkle.mesh.DeviceMesh")
        return device_mesh
    try:
        from twinkle.mesh import get_global_mesh
        from twinkle.mesh.runtime import get_runtime
    except ImportError:
        return _SingleRank()
    runtime = get_runtime()
    if runtime is not None and runtime.mode == "ray":
        # The Ray driver is no data rank: it feeds whole global batches and the remote groups
        # split them across their ranks (remote_method dispatch='slice').
        return _SingleRank()
    return get_global_mesh() or _SingleRank()


def slice_for_rank(mesh, rows: list) -> list:
    """This data rank's rows of a global batch: the mesh decides where it can; otherwise contiguous
    equal chunks in rank order."""
    if hasattr(mesh, "slice_for_data_rank"):
        return list(mesh.slice_for_data_rank(rows))
    world, rank = mesh.data_world_size, mesh.data_rank
    per_rank = len(rows) // world
    return rows[rank * per_rank : (rank + 1) * per_rank]
