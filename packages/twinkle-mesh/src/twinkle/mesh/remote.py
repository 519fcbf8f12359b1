"""remote_class / remote_method: one component class, local object or Ray actor group.

`@remote_class` adds a `remote_group=` keyword to construction. In ray mode it returns a
RemoteGroup (twinkle.mesh.ray_group) over one actor per rank of that DeviceGroup; anywhere else
(local mode, torchrun, inside an actor) the keyword is accepted and ignored and a plain object is
built. `@remote_method` declares how a call fans out and how the answers come back; undeclared
public methods run on every rank and return rank 0's answer (SPMD ranks agree).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from twinkle.mesh.device_mesh import DeviceMesh, split_bounds

DISPATCH = ("all", "slice")
COLLECT = ("first", "all", "mean", "flatten", "merge")
_SPEC_ATTR = "__twinkle_remote__"


class RemoteError(RuntimeError):
    """A call failed on one or more ranks of a remote group; carries the remote traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str, exc_type: str):
        super().__init__(message)
        self.rank, self.remote_traceback, self.exc_type = rank, remote_traceback, exc_type


class WorkerDied(RemoteError):
    """A rank's actor process is gone (killed, out of memory, node lost): the group must be rebuilt."""


def remote_method(dispatch: str | Callable = "all", collect: str | Callable = "first"):
    """dispatch: 'all' (every rank gets the same arguments) or 'slice' (every list, tuple, tensor,
    or dict of those is cut along its first axis by data rank; scalars go to everyone), or a
    callable (args, kwargs, mesh, rank) -> (args, kwargs).
    collect: 'first' (rank 0), 'all' (list in rank order), 'mean' (of numbers, tensors or dicts of
    them), 'flatten' (ranks' lists concatenated), 'merge' (ranks' dicts: list values concatenated in
    rank order, numbers averaged, None kept), or a callable on the list of results.
    A subclass overriding a method without declaring it inherits its parent's declaration."""
    if not callable(dispatch) and dispatch not in DISPATCH:
        raise ValueError(f"remote_method dispatch={dispatch!r}; expected one of {DISPATCH} or a callable")
    if not callable(collect) and collect not in COLLECT:
        raise ValueError(f"remote_method collect={collect!r}; expected one of {COLLECT} or a callable")

    def mark(fn):
        setattr(fn, _SPEC_ATTR, (dispatch, collect))
        return fn

    return mark


def method_spec(cls: type, name: str) -> tuple:
    for klass in cls.__mro__:  # the nearest declaration: an undecorated override keeps its parent's
        fn = klass.__dict__.get(name)
        fn = getattr(fn, "__func__", fn)  # unwrap static/class methods
        if hasattr(fn, _SPEC_ATTR):
            return getattr(fn, _SPEC_ATTR)
    return ("all", "first")


C = TypeVar("C", bound=type)


def _wrap_init(cls: type) -> None:
    """Make cls.__init__ swallow `remote_group` unless it declares it itself."""
    init = cls.__init__
    if getattr(init, "__twinkle_wrapped__", False):
        return
    try:
        takes_it = "remote_group" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        takes_it = False

    @functools.wraps(init)
    def __init__(self, *args, remote_group=None, **kwargs):
        if takes_it:
            kwargs["remote_group"] = remote_group
        init(self, *args, **kwargs)

    # setattr: patching a class's methods at decoration time is dynamic by nature
    setattr(__init__, "__twinkle_wrapped__", True)
    setattr(cls, "__init__", __init__)


def remote_class(cls: C) -> C:
    """Class decorator: `Cls(..., remote_group='model')` is an actor group in ray mode. Subclasses
    inherit the behaviour (their own __init__ need not know about `remote_group`)."""
    if not isinstance(cls, type):
        raise TypeError(f"remote_class decorates classes, got {cls!r}")
    _wrap_init(cls)
    base_new = cls.__new__

    def __new__(klass, *args, remote_group=None, **kwargs):
        if remote_group is not None:
            from twinkle.mesh.runtime import get_runtime

            rt = get_runtime()
            if rt is not None and rt.mode == "ray":
                from twinkle.mesh.ray_group import RemoteGroup

                return RemoteGroup(klass, rt.group(remote_group), args, kwargs)
        if base_new is object.__new__:
            return object.__new__(klass)
        return base_new(klass, *args, **kwargs)

    setattr(cls, "__new__", staticmethod(__new__))
    parent_hook = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub, **kwargs):
        if parent_hook is not None:
            parent_hook.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)  # ty: ignore[invalid-super-argument] - cls is a class (C is bound to type); ty does not see a TypeVar as one
        _wrap_init(sub)

    setattr(cls, "__init_subclass__", classmethod(__init_subclass__))
    setattr(cls, "__twinkle_remote_class__", True)
    return cls


# -- fan-out and fan-in ---------------------------------------------------------------------------
def _sliceable(value) -> bool:
    if isinstance(value, (list, tuple, torch.Tensor)):
        return not (isinstance(value, torch.Tensor) and value.dim() == 0)
    return isinstance(value, Mapping) and bool(value) and all(_sliceable(v) for v in value.values())


def _cut(value, data_rank: int, parts: int):
    if isinstance(value, Mapping):
        return type(value)({k: _cut(v, data_rank, parts) for k, v in value.items()})
    start, stop = split_bounds(len(value), parts, data_rank)
    return value[start:stop]


def dispatch_args(dispatch, args: tuple, kwargs: dict, mesh: DeviceMesh, rank: int) -> tuple[tuple, dict]:
    """The arguments rank `rank` receives."""
    if callable(dispatch):
        return dispatch(args, kwargs, mesh, rank)
    if dispatch == "all":
        return args, kwargs
    data_rank, parts = mesh.get_rank("data", rank), mesh.data_world_size

    def cut(v):
        return _cut(v, data_rank, parts) if _sliceable(v) else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _mean(values: list):
    first = values[0]
    if isinstance(first, Mapping):
        return {k: _mean([v[k] for v in values]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack([v.float() for v in values]).mean(0)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(values) / len(values)
    raise TypeError(f"collect='mean' needs numbers, tensors or dicts of them, got {type(first).__name__}")


def collect_results(collect, results: list):
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
