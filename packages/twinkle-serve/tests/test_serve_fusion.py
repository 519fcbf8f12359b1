"""One scheduler for both APIs: a native forward_backward and a Tinker one queued together run in one
fused pass (the base model's worker is held for a moment so both are waiting when it frees)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from twinkle.hub import TEST_MODEL
from twinkle.serve.core.work import Call, StoredAnswer

SEQ = [4 + (7 * i) % 70 for i in range(20)]


def _until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_native_and_tinker_requests_share_one_pass(server, sft):
    import tinker

    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    key = server.create_key("fuse-mix")
    scheduler = server.runtime.engines[TEST_MODEL].scheduler
    tc = (
        tinker.ServiceClient(base_url=server.url, api_key=key)
        .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2)
        .result()
    )
    native = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(server.url, key), name="fuse-native")
    native.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    rows = [{"input_ids": SEQ, "labels": SEQ}]
    float(native.forward_backward(inputs=rows)["loss"])  # both adapters exist: their next passes may fuse
    tc.forward_backward([sft(SEQ)], "cross_entropy").result()
    passes, items = scheduler.fused_passes, dict(scheduler.fused_items)

    gate, held = threading.Event(), threading.Event()

    def hold():
        held.set()
        gate.wait(60)
        return StoredAnswer.json({})

    scheduler.submit(Call("test-gate", None, server.runtime.hub.create("fuse-mix"), hold))
    _until(held.is_set)
    native_out = native.forward_backward(inputs=rows)
    tinker_out = tc.forward_backward([sft(SEQ)], "cross_entropy")
    _until(lambda: scheduler.pending(native.model_id) == 1 and scheduler.pending(tc.model_id) == 1)
    gate.set()
    native_loss = float(native_out["loss"])
    tinker_loss = tinker_out.result().metrics["loss:sum"]

    assert scheduler.fused_passes == passes + 1
    assert scheduler.fused_items["native"] == items.get("native", 0) + 1
    assert scheduler.fused_items["tinker"] == items.get("tinker", 0) + 1
    # no optimizer step since: an unfused forward of each sees the same weights, so the same loss
    assert float(native.forward_only(inputs=rows)["loss"]) == pytest.approx(native_loss, rel=1e-5)
    assert tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(tinker_loss, rel=1e-5)
    (status,) = httpx.get(f"{server.url}/twinkle/v1/server", headers={"X-API-Key": key}).json()["base_models"]
    assert status["fused_requests"]["native"] >= 1 and status["fused_requests"]["tinker"] >= 1
