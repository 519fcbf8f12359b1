"""RemoteClass / remote_method: one component class, local object or Ray actor group.

A class built with `metaclass=RemoteClass` takes a `remote_group=` keyword at construction: in ray
mode `Cls(..., remote_group='model')` is a RemoteGroup (twinkle.mesh.ray_group) over one actor per
rank of that DeviceGroup; anywhere else (local mode, torchrun, inside an actor) the keyword is
ignored and a plain object is built. `@remote_method` declares how a call fans out and how the
answers come back; undeclared public methods run on every rank and return rank 0's answer (SPMD
ranks agree).
"""

from __future__ import annotations

from abc import ABCMeta
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from twinkle.mesh.dispatch import COLLECT, DISPATCH, SPEC_ATTR, Collect, Dispatch, RemoteError, WorkerDied, method_spec
from twinkle.mesh.runtime import get_runtime

if TYPE_CHECKING:  # ray_group imports Ray, an optional extra
    from twinkle.mesh.ray_group import RemoteGroup

__all__ = ["RemoteClass", "RemoteError", "WorkerDied", "method_spec", "remote_method"]


F = TypeVar("F", bound=Callable)


def remote_method(dispatch: str | Dispatch = "all", collect: str | Collect = "first") -> Callable[[F], F]:
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

    def mark(fn: F) -> F:
        setattr(fn, SPEC_ATTR, (dispatch, collect))
        return fn

    return mark


T = TypeVar("T")


class RemoteClass(ABCMeta):
    """The metaclass of a component that can run as a Ray actor group (ABCMeta's subclass, so an
    abstract base can use it too). Constructing such a class is this `__call__`: with
    `remote_group='name'` in ray mode it builds a RemoteGroup whose actors each construct the class
    from the other arguments; otherwise the object is built here as by any class. Subclasses
    inherit it, and no `__init__` ever receives `remote_group`."""

    @overload
    def __call__(cls: type[T], *args: Any, remote_group: str | None, **kwargs: Any) -> T | RemoteGroup: ...
    @overload
    def __call__(cls: type[T], *args: Any, **kwargs: Any) -> T: ...
    def __call__(cls, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        runtime = get_runtime()
        if remote_group is not None and runtime is not None and runtime.mode == "ray":
            from twinkle.mesh.ray_group import RemoteGroup

            return RemoteGroup(cls, runtime.group(remote_group), args, kwargs)
        return super().__call__(*args, **kwargs)
