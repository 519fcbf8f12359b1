"""The twinkle-kit conformance suite: one real server (uvicorn on a loopback port, the test model)
for the scripts that talk to one, and a model to measure whether a saved adapter learned."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="session")
def kit_server(tmp_path_factory):
    import torch
    from kit_runner import start_server

    torch.set_num_threads(2)
    srv = start_server(tmp_path_factory.mktemp("kit-serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def kit_env(kit_server):
    """What twinkle-kit's scripts read: TWINKLE_SERVER_URL / TWINKLE_SERVER_TOKEN."""
    key = kit_server.create_key("twinkle-kit")
    return {"TWINKLE_SERVER_URL": kit_server.url, "TWINKLE_SERVER_TOKEN": key}
