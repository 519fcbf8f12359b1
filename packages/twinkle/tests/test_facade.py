"""The meta facade spans the namespace and dispatches initialize() to the package owning the mode."""

import pytest

import twinkle


def test_namespace_spans_every_member():
    import twinkle.client
    import twinkle.hub
    import twinkle.model

    assert twinkle.hub.TEST_MODEL.startswith("twinkle://")
    assert any(p.endswith("twinkle-model/src/twinkle") for p in map(str, twinkle.__path__))


def test_twinkle_kit_top_level_names_are_the_members_own():
    from twinkle_client import init_twinkle_client

    assert twinkle.init_twinkle_client is init_twinkle_client


def test_unknown_mode_names_the_modes():
    with pytest.raises(ValueError, match=r"unknown mode 'grpc'; expected one of \['http', 'local', 'ray'\]"):
        twinkle.initialize(mode="grpc")


def test_missing_distribution_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "twinkle.serve", None)  # as if twinkle-serve were not installed
    with pytest.raises(ImportError, match="pip install 'twinkle-serve'"):
        twinkle.initialize(mode="http")
