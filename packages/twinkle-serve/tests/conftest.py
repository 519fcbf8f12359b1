"""One real server (uvicorn on a free loopback port, the embedded test model) shared by the suite,
and the unmodified tinker SDK pointed at it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")

from twinkle.hub import TEST_MODEL


def start_server(data_dir, **config):
    import twinkle.serve as ts

    config = {"models": [{"name": TEST_MODEL}], **config}
    return ts.initialize(
        mode="http", port=0, data_dir=data_dir, config=config, block=False, log_level="warning"
    ).wait_ready()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    import torch

    torch.set_num_threads(2)
    srv = start_server(
        tmp_path_factory.mktemp("serve-data"),
        limits={"max_models": 32},
        tenant_limits={"carol": {"max_models": 3, "max_input_tokens": 4096}, "erin": {"requests_per_s": 2}},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keys(server):
    return {name: server.create_key(name) for name in ("alice", "bob", "carol", "erin")}


@pytest.fixture(scope="session")
def alice(server, keys):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=keys["alice"])


@pytest.fixture(scope="session")
def bob(server, keys):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=keys["bob"])


def sft_datum(tokens):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="session")
def sft():
    """sft(tokens) -> a next-token Datum (input tokens[:-1], targets tokens[1:], unit weights)."""
    return sft_datum


@pytest.fixture(scope="session")
def start():
    """start(data_dir, **config) -> a running Server on the test model."""
    return start_server


@pytest.fixture(scope="module")
def tenant_key(server, request):
    """A key of the test module's own tenant (named by its module-level TENANT)."""
    return server.create_key(request.module.TENANT)
