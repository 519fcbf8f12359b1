"""Where models and datasets come from: hub ids, local folders, and the embedded defaults."""

from twinkle.hub.embedded import DEFAULT_MODEL, PRESETS, TEST_MODEL, cache_root, embedded_path
from twinkle.hub.resolve import OfflineError, resolve_model_path

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "TEST_MODEL",
    "OfflineError",
    "cache_root",
    "embedded_path",
    "resolve_model_path",
]
