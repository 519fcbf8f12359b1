"""The dashboard's data shows runs of both APIs with their curves: a run trained with the unmodified
Tinker SDK shows its steps and per-step losses, as one trained through the native client does."""

from __future__ import annotations

import httpx
import pytest

from twinkle.hub import TEST_MODEL

SEQ = [7 + (5 * i) % 60 for i in range(18)]


def test_runs_of_both_apis_show_their_steps_and_loss(server, sft):
    import tinker
    from tinker import types

    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    key = server.create_key("dash-both")
    tc = (
        tinker.ServiceClient(base_url=server.url, api_key=key)
        .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1)
        .result()
    )
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    tc.forward([sft(SEQ)], "cross_entropy").result()  # a forward alone is no training step
    native = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(server.url, key), name="dash-native")
    native.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    native_loss = float(native.forward_backward(inputs=[{"input_ids": SEQ, "labels": SEQ}])["loss"])

    summary = httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": key}).json()
    runs = {r["api"]: r for r in summary["runs"]}
    assert set(runs) == {"tinker", "native"}
    tinker_run = runs["tinker"]
    assert tinker_run["model_id"] == tc.model_id and tinker_run["steps"] == 3
    assert tinker_run["last_loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert [p["value"] for p in tinker_run["curves"]["loss"]] == pytest.approx(losses, rel=1e-6)
    assert [p["step"] for p in tinker_run["curves"]["loss"]] == [1, 2, 3]
    assert len(set(losses)) == 3  # a real curve: the optimizer steps ran between the points
    assert runs["native"]["steps"] == 1 and runs["native"]["last_loss"] == pytest.approx(native_loss, rel=1e-6)
    # the run's full curves carry the optimizer's numbers too
    curves = httpx.get(f"{server.url}/twinkle/v1/runs/{tc.model_id}/curves", headers={"X-API-Key": key}).json()
    assert len(curves["curves"]["grad_norm"]) == 3 and all(p["value"] > 0 for p in curves["curves"]["grad_norm"])
    # the engine counts each request's FLOPs: every training point carries its MFU (a fraction of the peak)
    assert len(curves["curves"]["mfu"]) == 3 and all(0 < p["value"] < 1 for p in curves["curves"]["mfu"])
    native_curves = httpx.get(
        f"{server.url}/twinkle/v1/runs/{native.model_id}/curves", headers={"X-API-Key": key}
    ).json()
    assert [0 < p["value"] < 1 for p in native_curves["curves"]["mfu"]] == [True]
