"""Sampler classes by name: entry points of group `twinkle.sampler` plus runtime registrations.

A name on the wire ("TorchSampler") picks a class; nothing is unpickled from a request.
"""

from __future__ import annotations

from importlib.metadata import entry_points

GROUP = "twinkle.sampler"
_registered: dict[str, type] = {}


def register_sampler(name: str, cls: type) -> type:
    from twinkle.sampler.base import Sampler

    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise TypeError(f"{cls!r} is not a Sampler subclass")
    _registered[name] = cls
    return cls


def get_sampler_class(name: str) -> type:
    if name in _registered:
        return _registered[name]
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in found:
        raise KeyError(f"unknown sampler {name!r}; known: {sorted(set(found) | set(_registered))}")
    return found[name].load()
