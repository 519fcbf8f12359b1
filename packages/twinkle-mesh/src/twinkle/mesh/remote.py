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
from collections.abc import Callable
from typing import TypeVar

from twinkle.mesh.dispatch import COLLECT, DISPATCH, SPEC_ATTR, RemoteError, WorkerDied, method_spec

__all__ = ["RemoteError", "WorkerDied", "method_spec", "remote_class", "remote_method"]


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
        setattr(fn, SPEC_ATTR, (dispatch, collect))
        return fn

    return mark


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
