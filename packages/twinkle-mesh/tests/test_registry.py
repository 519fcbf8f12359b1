"""twinkle.registry: the one name -> class registry behind every extension point."""

from __future__ import annotations

import pytest

from twinkle.registry import Registry, UnknownNameError


class Base:
    pass


def _registry() -> Registry[Base]:
    return Registry("widget", "twinkle.test-widget", Base)


def test_decorator_registers_name_and_aliases_and_create_builds():
    reg = _registry()

    @reg.register
    class Knob(Base):
        aliases = ("knob",)

        def __init__(self, size: int = 1):
            self.size = size

    @reg.register(name="dial")
    class Dial(Base):
        pass

    assert reg.names() == ["Knob", "dial", "knob"]
    assert reg.get("knob") is Knob and reg.get(Dial) is Dial
    assert reg.create("Knob", size=3).size == 3
    ready = Knob()
    assert reg.create(ready) is ready
    with pytest.raises(TypeError, match=r"keyword arguments \['size'\] given with a ready widget instance"):
        reg.create(ready, size=2)


def test_unknown_name_is_one_error_type_listing_the_known_names():
    reg = _registry()
    reg.register(type("Knob", (Base,), {}))
    with pytest.raises(UnknownNameError) as info:
        reg.get("Nob")
    assert str(info.value) == (
        "unknown widget 'Nob'; known: Knob (more can be added through the entry-point group 'twinkle.test-widget')"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert info.value.known == ["Knob"]


def test_non_subclasses_are_refused():
    reg = _registry()
    with pytest.raises(TypeError, match="is not a Base subclass, so it cannot be a widget"):
        reg.register(int)
    with pytest.raises(TypeError, match="is not a Base subclass"):
        reg.get(int)


def test_entry_points_of_installed_members_load_on_first_lookup():
    # twinkle-data is in this session's test group: its preprocessors are declared as entry points.
    from twinkle.preprocessor import Preprocessor

    reg = Registry("preprocessor", "twinkle.preprocessor", Preprocessor)
    cls = reg.get("AlpacaProcessor")
    assert cls.__name__ == "AlpacaProcessor" and issubclass(cls, Preprocessor)
    assert "SelfCognitionProcessor" in reg.names()
