"""Name -> class registries for the extension points (losses, metrics, patches, models).

A name arriving over the wire picks a class; nothing is ever unpickled. Built-in classes register
with the decorator when their module is imported; third-party ones are found through Python entry
points (group `twinkle.loss`, `twinkle.metric`, ...), loaded lazily on the first unknown name.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, group: str, base: type[T]):
        self.kind, self.group, self.base = kind, group, base
        self._classes: dict[str, type[T]] = {}
        self._entry_points_loaded = False

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: registers `cls` under its class name and its `aliases`."""
        for name in (cls.__name__, *getattr(cls, "aliases", ())):
            self._classes[name] = cls
        return cls

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name in self._classes:
                continue  # already registered in-process (the built-ins are also declared as entry points)
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"entry point {ep.name}={ep.value} in {self.group} is not a "
                                f"{self.base.__name__} subclass")
            self._classes[ep.name] = cls
            for alias in getattr(cls, "aliases", ()):
                self._classes.setdefault(alias, cls)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._classes)

    def get(self, name_or_cls: str | type[T]) -> type[T]:
        if isinstance(name_or_cls, type):
            if not issubclass(name_or_cls, self.base):
                raise TypeError(f"{name_or_cls.__name__} is not a {self.base.__name__} subclass")
            return name_or_cls
        if name_or_cls not in self._classes:
            self._load_entry_points()
        try:
            return self._classes[name_or_cls]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name_or_cls!r}; registered: "
                             f"{', '.join(self.names())}") from None

    def create(self, name_or_cls: str | type[T] | T, **kwargs) -> T:
        """An instance from a name, a class, or an instance passed through unchanged."""
        if isinstance(name_or_cls, self.base):
            if kwargs:
                raise TypeError(f"keyword arguments {sorted(kwargs)} given with a ready {self.kind} instance")
            return name_or_cls
        return self.get(name_or_cls)(**kwargs)
