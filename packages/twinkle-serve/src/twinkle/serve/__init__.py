"""twinkle.serve: the multi-tenant training service, reachable by the unmodified Tinker SDK.

import twinkle
server = twinkle.initialize(mode="http", port=8000, data_dir="./data", block=False)
key = server.create_key("alice")          # or: twinkle-server keys create alice
"""

from twinkle.serve.config import Limits, ModelEntry, ServeConfig, load_config
from twinkle.serve.keys import KeyStore
from twinkle.serve.server import Server, default_data_dir, free_port, initialize

__all__ = [
    "KeyStore",
    "Limits",
    "ModelEntry",
    "ServeConfig",
    "Server",
    "default_data_dir",
    "free_port",
    "initialize",
    "load_config",
]
