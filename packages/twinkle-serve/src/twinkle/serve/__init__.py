"""twinkle.serve: the multi-tenant training service, reachable by the unmodified Tinker SDK.

import twinkle
server = twinkle.initialize(mode="http", port=8000, data_dir="./data", block=False)
key = server.create_key("alice")          # or: twinkle-server keys create alice
"""

from __future__ import annotations

import importlib

# name -> the module that defines it, imported on first use: `twinkle-server keys ...` reads only the
# store, and must not pay for torch and the engines the server itself loads (it took 11 s and 0.86 GiB).
_EXPORTS = {
    "KeyStore": "twinkle.serve.keys",
    "Limits": "twinkle.serve.config",
    "ModelEntry": "twinkle.serve.config",
    "ServeConfig": "twinkle.serve.config",
    "load_config": "twinkle.serve.config",
    "default_data_dir": "twinkle.serve.core.store",
    "Server": "twinkle.serve.server",
    "free_port": "twinkle.serve.server",
    "initialize": "twinkle.serve.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'twinkle.serve' has no attribute {name!r}")
