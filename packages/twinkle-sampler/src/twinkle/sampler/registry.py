"""Sampler classes by name: entry points of group `twinkle.sampler` plus runtime registrations.

A name on the wire ("TorchSampler") picks a class; nothing is unpickled from a request.
"""

from __future__ import annotations

from twinkle.registry import Registry
from twinkle.sampler.base import Sampler

SAMPLERS: Registry[Sampler] = Registry("sampler", "twinkle.sampler", Sampler)
get_sampler_class = SAMPLERS.get


def register_sampler(name: str, cls: type[Sampler]) -> type[Sampler]:
    return SAMPLERS.register(cls, name=name)
