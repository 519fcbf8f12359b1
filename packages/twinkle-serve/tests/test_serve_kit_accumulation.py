"""twinkle-kit's per-call accumulation window over HTTP: `clip_grad_and_step(gradient_accumulation_steps=n)`
on twinkle_client's model resizes the adapter's window from that call on, as the in-process
TransformersModel's does. Two tenants train the same LoRA (same seed) on the same two micro-batches, one
with a window of 2 from the start, one widening its window of 1 at its first step: the same one step, the
same weights after it. Shrinking a window that has begun fails by name; a window below 1 is a 4xx."""

from __future__ import annotations

import pytest

from twinkle.hub import TEST_MODEL

TENANT = "kit-accumulation"
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
BATCHES = [
    [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]}],
    [{"input_ids": [20, 21, 22, 23], "labels": [-100, -100, 22, 23]}],
]


def _model(server, key, name: str, gradient_accumulation_steps: int):
    from twinkle_client.model import MultiLoraTransformersModel

    from twinkle.client import TwinkleClient

    model = MultiLoraTransformersModel(TEST_MODEL, client=TwinkleClient(server.url, key), name=name, seed=7)
    model.add_adapter_to_model("default", LORA, gradient_accumulation_steps=gradient_accumulation_steps)
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def test_a_per_call_window_equals_the_window_set_at_the_start(server, tenant_key):
    fixed = _model(server, tenant_key, "gas-fixed", 2)
    widened = _model(server, tenant_key, "gas-widened", 1)
    base = widened.forward_only(BATCHES[0]).result["loss"]

    fixed.forward_backward(BATCHES[0])
    assert fixed.clip_grad_and_step().result["stepped"] is False
    fixed.forward_backward(BATCHES[1])
    assert fixed.clip_grad_and_step().result["stepped"] is True

    widened.forward_backward(BATCHES[0])
    first = widened.clip_grad_and_step(gradient_accumulation_steps=2).result
    assert first["stepped"] is False, "the window of 1 was widened to 2 by this call: no step yet"
    widened.forward_backward(BATCHES[1])
    second = widened.clip_grad_and_step().result
    assert second["stepped"] is True and second["step"] == 1

    tuned = [m.forward_only(BATCHES[0]).result["loss"] for m in (fixed, widened)]
    assert tuned[1] == pytest.approx(tuned[0], rel=1e-5)
    assert tuned[1] < base  # the step trained


def test_shrinking_a_begun_window_and_a_window_below_one_are_refused(server, tenant_key):
    from twinkle.client import TwinkleAPIError, TwinkleRequestFailed

    model = _model(server, tenant_key, "gas-shrink", 2)
    model.forward_backward(BATCHES[0])
    with pytest.raises(TwinkleRequestFailed, match="gradient_accumulation_steps=1: 1 micro-batch"):
        model.clip_grad_and_step(gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):  # the client's schema, before sending
        model.clip_grad_and_step(gradient_accumulation_steps=0)
    with pytest.raises(TwinkleAPIError, match="gradient_accumulation_steps") as err:  # the server's, if sent
        model.proxy.client.post(f"/models/{model.model_id}/clip_grad_and_step", {"gradient_accumulation_steps": 0})
    assert 400 <= err.value.status < 500
