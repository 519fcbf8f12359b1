"""One registry implementation behind every extension point, and every declared entry point loads."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from twinkle.registry import Registry, UnknownNameError


def _registries() -> dict[str, Registry]:
    from twinkle.advantage import ADVANTAGES
    from twinkle.checkpoint_engine.base import CHECKPOINT_ENGINES
    from twinkle.loss.base import LOSSES
    from twinkle.metric.base import METRICS
    from twinkle.model import MODELS
    from twinkle.patch.base import PATCHES
    from twinkle.preprocessor.base import FILTERS, PREPROCESSORS
    from twinkle.processor.input_processor import INPUT_PROCESSORS
    from twinkle.reward import REWARDS
    from twinkle.sampler.registry import SAMPLERS
    from twinkle.serve.backend import BACKENDS
    from twinkle.template.template import TEMPLATES

    found = [
        ADVANTAGES,
        CHECKPOINT_ENGINES,
        LOSSES,
        METRICS,
        MODELS,
        PATCHES,
        FILTERS,
        PREPROCESSORS,
        INPUT_PROCESSORS,
        REWARDS,
        SAMPLERS,
        BACKENDS,
        TEMPLATES,
    ]
    return {r.group: r for r in found}


def test_every_extension_point_is_the_one_registry_class():
    registries = _registries()
    assert len(registries) == 13 and all(type(r) is Registry for r in registries.values())


def test_every_declared_entry_point_resolves_through_its_registry():
    registries = _registries()
    declared = {g: [ep.name for ep in entry_points(group=g)] for g in registries}
    for group, names in declared.items():
        assert names, f"no entry points declared for {group}"
        # MegatronModel and VLLMSampler import their optional backend only when built, not when looked up.
        missing = [n for n in names if n not in registries[group].names()]
        assert not missing, f"{group}: entry points that did not load: {missing}"
    assert {"TransformersModel", "MultiLoraModel", "MegatronModel"} <= set(registries["twinkle.model"].names())


@pytest.mark.parametrize("group", ["twinkle.loss", "twinkle.sampler", "twinkle.checkpoint_engine", "twinkle.reward"])
def test_an_unknown_name_is_the_same_error_everywhere(group):
    registry = _registries()[group]
    with pytest.raises(UnknownNameError, match=rf"unknown {registry.kind} 'Nope'; known: "):
        registry.get("Nope")
