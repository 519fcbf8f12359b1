"""Name -> class registries filled from Python entry points.

A name that travels on the wire (``"SelfCognitionProcessor"``) picks a class from a registry; nothing is
ever unpickled. Built-in classes are declared as entry points of this distribution, so a third-party
package extends a registry the same way: ``[project.entry-points."twinkle.preprocessor"]``.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Registry(Generic[T]):
    """Classes of one kind, keyed by name; entry points of ``group`` are loaded on first lookup."""

    def __init__(self, group: str, base: type):
        self.group = group
        self.base = base
        self._classes: dict[str, type] = {}
        self._entry_points_loaded = False

    def register(self, cls: type | None = None, *, name: str | None = None):
        """Register ``cls`` (usable as a bare decorator or with ``name=``)."""

        def add(c: type) -> type:
            if not (isinstance(c, type) and issubclass(c, self.base)):
                raise TypeError(f"{c!r} is not a subclass of {self.base.__name__}")
            self._classes[name or c.__name__] = c
            return c

        return add(cls) if cls is not None else add

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name in self._classes:
                continue
            try:
                self.register(ep.load(), name=ep.name)
            except Exception as e:  # one broken plugin must not hide the others
                logger.warning("entry point %s=%s in group %s failed to load: %s", ep.name, ep.value,
                               self.group, e)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._classes)

    def classes(self) -> list[type]:
        self._load_entry_points()
        return list(self._classes.values())

    def get(self, name_or_cls: str | type) -> type:
        """The class for a registered name; a class is checked and returned as is."""
        if isinstance(name_or_cls, type):
            if not issubclass(name_or_cls, self.base):
                raise TypeError(f"{name_or_cls!r} is not a subclass of {self.base.__name__}")
            return name_or_cls
        self._load_entry_points()
        try:
            return self._classes[name_or_cls]
        except KeyError:
            raise KeyError(f"no {self.base.__name__} named {name_or_cls!r} (entry-point group "
                           f"{self.group!r}); known: {', '.join(self.names()) or 'none'}") from None

    def build(self, name_or_obj: Any, **kwargs: Any) -> Any:
        """An instance: instances pass through, names and classes are constructed with ``kwargs``."""
        if isinstance(name_or_obj, self.base):
            return name_or_obj
        return self.get(name_or_obj)(**kwargs)
