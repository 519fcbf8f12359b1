"""Twinkle: the facade. No logic of its own: it spans the namespace and dispatches `initialize`.

`twinkle` is a namespace shared by every member distribution (twinkle.mesh, twinkle.model, ...);
only this meta distribution ships `twinkle/__init__.py`, and `extend_path` keeps the namespace
spanning every member installed anywhere on sys.path (editable installs included). It is written in the
one-line `__import__("pkgutil")` form on purpose: that is the form static checkers (ty) recognise as a
namespace spanning its siblings; imported by name, ty takes this package to hide every sibling.
"""

from __future__ import annotations

import importlib

__path__ = __import__("pkgutil").extend_path(__path__, __name__)
__version__ = "0.1.0"

# mode -> (module that implements it, distribution that ships the module)
_MODES = {
    "local": ("twinkle.mesh", "twinkle-mesh"),
    "ray": ("twinkle.mesh", "twinkle-mesh[ray]"),
    "http": ("twinkle.serve", "twinkle-serve"),
}
# Names re-exported lazily, so `import twinkle` stays cheap and works with any subset installed:
# name -> (module, distribution). The client entry points are twinkle-kit's top-level names too.
_EXPORTS = {
    "DeviceMesh": ("twinkle.mesh", "twinkle-mesh"),
    "DeviceGroup": ("twinkle.mesh", "twinkle-mesh"),
    "get_device_placement": ("twinkle.mesh", "twinkle-mesh"),
    "get_logger": ("twinkle.mesh", "twinkle-mesh"),
    "init_twinkle_client": ("twinkle_client", "twinkle-client"),
    "init_tinker_client": ("twinkle_client", "twinkle-client"),
}


def _owner(module: str, dist: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise ImportError(f"{module} is not installed: pip install {dist!r}") from e
        raise


def initialize(mode: str = "local", **kwargs):
    """Start Twinkle in `mode` ('local' covers one process and torchrun, 'ray', or 'http')."""
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(_MODES)}")
    return _owner(*_MODES[mode]).initialize(mode=mode, **kwargs)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_owner(*_EXPORTS[name]), name)
    raise AttributeError(f"module 'twinkle' has no attribute {name!r}")
