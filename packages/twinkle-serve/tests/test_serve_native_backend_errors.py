"""The native API on the backends: one sampling remotely but training in process is served (native
operations through the remote backend's local shard equal the plain backend); an unknown backend is
a config error listing the known ones."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from twinkle.serve.config import ServeConfig


def test_backends_come_from_the_one_registry_and_an_unknown_name_lists_the_known():
    from twinkle.serve.backend import BACKENDS
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

    assert BACKENDS.get("multi_lora") is MultiLoraBackend  # through the twinkle.serve_backend entry point
    with pytest.raises(ValidationError) as err:
        ServeConfig.model_validate({"models": [{"name": "m", "backend": "fused"}]})
    assert "unknown serve backend 'fused'; known: multi_lora" in str(err.value)


def test_native_operations_on_the_remote_backends_local_trainer():
    """sampler_remote_group only: training stays in process, and the native API's operations (through
    the Backend protocol) give the plain backend's numbers."""
    from peft import LoraConfig

    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend import RowsPass
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
    from twinkle.serve.backend.remote import RemoteBackend

    path = str(resolve_model_path(TEST_MODEL))
    rows = [{"input_ids": list(range(5, 20)), "labels": list(range(5, 20))}]
    losses = []
    for backend in (MultiLoraBackend(TEST_MODEL, path), RemoteBackend(TEST_MODEL, path)):
        assert backend.base_module is not None  # training in this process: the base is here
        assert backend.add_lora("a", LoraConfig(r=4, target_modules=["q_proj"]), 1, 3) == 4
        backend.configure_adapter("a", "optimizer", "AdamW", {"lr": 1e-4})  # the contract: no implicit one
        (out,) = backend.forward_backward_many([RowsPass("a", rows, False)])
        backend.clip_grad_and_step("a", 1.0)
        (again,) = backend.forward_backward_many([RowsPass("a", rows, True)])
        losses.append((out["loss"], again["loss"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0][1] != losses[0][0]
