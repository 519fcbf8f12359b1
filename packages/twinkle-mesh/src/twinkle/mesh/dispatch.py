"""What a remote group does with one call, independent of how its ranks run (Ray actors today):
the arguments each rank receives (`dispatch_args`), how the ranks' results combine into one
(`collect_results`), the declaration `@remote_method` left on a method (`method_spec`), and the
errors a group raises. `twinkle.mesh.remote` declares; `twinkle.mesh.ray_group` executes; both read
this module, so neither imports the other at module level."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from twinkle.mesh.device_mesh import DeviceMesh, split_bounds

DISPATCH = ("all", "slice")
COLLECT = ("first", "all", "mean", "flatten", "merge")
SPEC_ATTR = "__twinkle_remote__"
# a callable dispatch: (args, kwargs, mesh, rank) -> the (args, kwargs) that rank receives
Dispatch = Callable[[tuple, dict, DeviceMesh, int], tuple[tuple, dict]]
Collect = Callable[[list], Any]  # a callable collect: the ranks' results -> the call's result


class RemoteError(RuntimeError):
    """A call failed on one or more ranks of a remote group; carries the remote traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str, exc_type: str) -> None:
        super().__init__(message)
        self.rank, self.remote_traceback, self.exc_type = rank, remote_traceback, exc_type


class WorkerDied(RemoteError):
    """A rank's actor process is gone (killed, out of memory, node lost): the group must be rebuilt."""


def method_spec(cls: type, name: str) -> tuple:
    for klass in cls.__mro__:  # the nearest declaration: an undecorated override keeps its parent's
        fn = klass.__dict__.get(name)
        fn = getattr(fn, "__func__", fn)  # unwrap static/class methods
        if hasattr(fn, SPEC_ATTR):
            return getattr(fn, SPEC_ATTR)
    return ("all", "first")


# -- fan-out and fan-in ---------------------------------------------------------------------------
def _sliceable(value: object) -> bool:
    if isinstance(value, (list, tuple, torch.Tensor)):
        return not (isinstance(value, torch.Tensor) and value.dim() == 0)
    return isinstance(value, Mapping) and bool(value) and all(_sliceable(v) for v in value.values())


def _cut(value: Any, data_rank: int, parts: int) -> Any:
    if isinstance(value, Mapping):
        return type(value)({k: _cut(v, data_rank, parts) for k, v in value.items()})
    start, stop = split_bounds(len(value), parts, data_rank)
    return value[start:stop]


def dispatch_args(
    dispatch: str | Dispatch, args: tuple, kwargs: dict, mesh: DeviceMesh, rank: int
) -> tuple[tuple, dict]:
    """The arguments rank `rank` receives."""
    if not isinstance(dispatch, str):
        return dispatch(args, kwargs, mesh, rank)
    if dispatch == "all":
        return args, kwargs
    data_rank, parts = mesh.get_rank("data", rank), mesh.data_world_size

    def cut(v: Any) -> Any:
        return _cut(v, data_rank, parts) if _sliceable(v) else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _mean(values: list) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        return {k: _mean([v[k] for v in values]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack([v.float() for v in values]).mean(0)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(values) / len(values)
    raise TypeError(f"collect='mean' needs numbers, tensors or dicts of them, got {type(first).__name__}")


def collect_results(collect: str | Collect, results: list) -> Any:
    if callable(collect):
        return collect(results)
    if collect == "first":
        return results[0]
    if collect == "all":
        return list(results)
    if collect == "mean":
        return _mean(results)
    if collect == "merge":
        return _merge(results)
    return _flatten(results)


def _merge(results: list) -> dict:
    out = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if all(v is None for v in values):
            out[key] = None
        elif isinstance(values[0], (list, tuple)):
            out[key] = _flatten(values)
        elif isinstance(values[0], torch.Tensor) and values[0].dim() > 0:  # per-row values: rows in rank order
            out[key] = torch.cat(values)
        else:
            out[key] = _mean(values)
    return out


def _flatten(results: list) -> list:
    flat = []
    for rank, r in enumerate(results):
        if not isinstance(r, (list, tuple)):
            raise TypeError(
                f"collect='flatten' needs every rank to return a list; rank {rank} returned {type(r).__name__}"
            )
        flat.extend(r)
    return flat
