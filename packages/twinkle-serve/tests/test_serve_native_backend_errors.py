"""The native API names what it really needs when a base model's backend cannot serve it: a model
training on a Ray remote group is refused for where it runs; one sampling remotely but training in
process is served (native rows through the remote backend's local shard equal the plain backend);
the removed `peft` backend is a config error naming its replacement."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from twinkle.serve.config import ModelEntry, ServeConfig
from twinkle.serve.core.records import Run
from twinkle.serve.core.service import Service
from twinkle.serve.errors import BadRequest
from twinkle.serve.native.models import NativeModels
from twinkle.serve.runtime import Engine, Runtime


class _RemoteLike:
    """What RemoteBackend declares: its MultiLoraModel lives on the shards, not in this process."""

    multi_lora = None


def test_native_refusal_says_what_is_required(tmp_path):
    entry, words = ModelEntry(name="m", remote_group="model"), ["Ray remote group 'model'", "server process", "/api/v1"]
    rt = Runtime(ServeConfig(), tmp_path)
    try:
        rt.engines["m"] = Engine(entry, _RemoteLike(), scheduler=None)
        run = Run("s:train:0", "t", "s", "m", "native", {}, 0.0)
        with pytest.raises(BadRequest) as err:
            NativeModels(Service(rt)).engine_of(run)
        assert all(w in err.value.message for w in words), err.value.message
    finally:
        rt.store.close()


def test_the_removed_peft_backend_names_its_replacement():
    with pytest.raises(ValidationError) as err:
        ServeConfig.model_validate({"models": [{"name": "m", "backend": "peft"}]})
    assert "backend 'peft' was removed" in str(err.value) and "use backend 'multi_lora'" in str(err.value)


def test_backends_come_from_the_one_registry_and_an_unknown_name_lists_the_known():
    from twinkle.serve.backend import BACKENDS
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

    assert BACKENDS.get("multi_lora") is MultiLoraBackend  # through the twinkle.serve_backend entry point
    with pytest.raises(ValidationError) as err:
        ServeConfig.model_validate({"models": [{"name": "m", "backend": "fused"}]})
    assert "unknown serve backend 'fused'; known: multi_lora" in str(err.value)


def test_native_rows_run_on_the_remote_backends_local_trainer():
    """sampler_remote_group only: training stays in process, so native passes run (and equal the plain backend)."""
    from peft import LoraConfig

    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend import RowsPass
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
    from twinkle.serve.backend.remote import RemoteBackend

    path = str(resolve_model_path(TEST_MODEL))
    rows = [{"input_ids": list(range(5, 20)), "labels": list(range(5, 20))}]
    losses = []
    for backend in (MultiLoraBackend(TEST_MODEL, path), RemoteBackend(TEST_MODEL, path)):
        assert backend.multi_lora is not None and backend.base_module is not None
        backend.multi_lora.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["q_proj"]), seed=3)
        backend.multi_lora.set_optimizer("AdamW", adapter_name="a", lr=1e-4)  # the contract: no implicit one
        (out,) = backend.forward_backward_many([RowsPass("a", rows, False)])
        backend.multi_lora.clip_grad_and_step(max_grad_norm=1.0, adapter_name="a")
        (again,) = backend.forward_backward_many([RowsPass("a", rows, True)])
        losses.append((out["loss"], again["loss"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0][1] != losses[0][0]
