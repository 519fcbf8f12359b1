"""Name -> class registries: the one implementation behind every extension point.

Losses, metrics, patches, preprocessors, filters, input processors, templates, models, samplers,
checkpoint engines, rewards, advantages and the server's backends are each a `Registry`. A name that
arrives on the wire (`"GRPOLoss"`) picks a class; nothing is ever unpickled. Built-in classes
register with the decorator when their module is imported, and are also declared as Python entry
points, which is how a third-party package adds its own:

    [project.entry-points."twinkle.loss"]
    MyLoss = "my_package.losses:MyLoss"

It lives in the lowest layer (twinkle-mesh) so that every member shares it, and every unknown name
raises the same `UnknownNameError`, listing the names that are known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar, cast, overload

T = TypeVar("T")
C = TypeVar("C", bound=type)
logger = logging.getLogger(__name__)


class UnknownNameError(KeyError, ValueError):
    """No class of this kind is registered under the name. A KeyError for lookups, a ValueError for
    arguments: callers of either convention catch it."""

    def __init__(self, kind: str, name: object, group: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        super().__init__(
            f"unknown {kind} {name!r}; known: {', '.join(known) or 'none'} "
            f"(more can be added through the entry-point group {group!r})"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Classes of one kind by name. Entry points of `group` load on the first lookup that needs them."""

    def __init__(self, kind: str, group: str, base: type[T]) -> None:
        self.kind, self.group, self.base = kind, group, base
        self._classes: dict[str, type[T]] = {}
        self._entry_points_loaded = False

    def _check(self, cls: object) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__} subclass, so it cannot be a {self.kind}")
        return cls

    # C, not T: a decorated class keeps its own type (its constructor) for type checkers
    @overload
    def register(self, cls: C, *, name: str | None = None) -> C: ...
    @overload
    def register(self, cls: None = None, *, name: str | None = None) -> Callable[[C], C]: ...
    def register(self, cls: C | None = None, *, name: str | None = None) -> C | Callable[[C], C]:
        """Class decorator (bare or with `name=`): registers the class under its name and its `aliases`."""

        def add(c: C) -> C:
            checked = self._check(c)
            for key in (name or c.__name__, *getattr(checked, "aliases", ())):
                self._classes[key] = checked
            return c

        return add(cls) if cls is not None else add

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name in self._classes:
                continue  # registered in-process already (the built-ins are entry points too)
            try:
                self.register(ep.load(), name=ep.name)
            except Exception as e:  # one broken plugin must not hide the others
                logger.warning("entry point %s=%s in group %s was not loaded: %s", ep.name, ep.value, self.group, e)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._classes)

    def classes(self) -> list[type[T]]:
        self._load_entry_points()
        return list(dict.fromkeys(self._classes.values()))

    def get(self, name_or_cls: str | type[T]) -> type[T]:
        """The class registered under a name; a class is checked and returned as it is."""
        if isinstance(name_or_cls, type):
            return self._check(name_or_cls)
        if name_or_cls not in self._classes:
            self._load_entry_points()
        try:
            return self._classes[name_or_cls]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name_or_cls, self.group, self.names()) from None

    def create(self, name_or_obj: str | type[T] | T, **kwargs: Any) -> T:
        """An instance from a name or a class (built with `kwargs`); an instance passes through."""
        if isinstance(name_or_obj, self.base):
            if kwargs:
                raise TypeError(f"keyword arguments {sorted(kwargs)} given with a ready {self.kind} instance")
            return name_or_obj
        # Not an instance of base: a name or a class (ty cannot narrow T away through `self.base`).
        return self.get(cast("str | type[T]", name_or_obj))(**kwargs)
