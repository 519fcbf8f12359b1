"""The native API names what it really needs when a base model's backend cannot serve it: a model on
Ray remote groups is refused for where it runs (not for a backend name it already has)."""

from __future__ import annotations

import types

import pytest

from twinkle.serve.config import ModelEntry, ServeConfig
from twinkle.serve.errors import BadRequest
from twinkle.serve.native.service import NativeService
from twinkle.serve.runtime import Engine, Runtime


@pytest.mark.parametrize("entry, words", [
    (ModelEntry(name="m", remote_group="model"), ["Ray remote group 'model'", "in the server process", "/api/v1"]),
    (ModelEntry(name="m", sampler_remote_group="sampler"), ["samples on the Ray remote group 'sampler'",
                                                            "in the server process"]),
    (ModelEntry(name="m", backend="peft"), ["runs the 'peft' backend", "needs backend 'multi_lora'"]),
])
def test_native_refusal_says_what_is_required(tmp_path, entry, words):
    rt = Runtime(ServeConfig(), tmp_path)
    try:
        # a backend without the in-process MultiLoraModel (`.engine`), as RemoteBackend and PeftBackend are
        rt.engines["m"] = Engine(entry, types.SimpleNamespace(), scheduler=None)
        with pytest.raises(BadRequest) as err:
            NativeService(rt).engine_of({"base_model": "m"})
        assert all(w in err.value.message for w in words), err.value.message
        if entry.remote_group or entry.sampler_remote_group:
            assert "runs the 'multi_lora' backend" not in err.value.message
    finally:
        rt.store.close()
