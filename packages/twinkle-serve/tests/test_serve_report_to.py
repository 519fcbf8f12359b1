"""`report_to` in the server config: every run's curves, from both APIs, reach the experiment
tracker, read back here with TensorBoard's own reader."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from twinkle.serve.config import ServeConfig


def test_an_unknown_tracker_is_refused_at_config_load():
    with pytest.raises(ValidationError, match="tensorbored"):
        ServeConfig.model_validate({"models": [{"name": "m"}], "report_to": "tensorbored"})


def test_tinker_steps_reach_tensorboard_per_run(start, tmp_path, sft):
    import tinker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tinker import types

    from twinkle.hub import TEST_MODEL

    srv = start(tmp_path / "data", report_to="tensorboard")
    try:
        client = tinker.ServiceClient(base_url=srv.url, api_key=srv.create_key("alice"))
        tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
        losses = []
        for _ in range(3):
            fb = tc.forward_backward([sft([5, 6, 7, 8, 9, 10])], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        model_id = tc.model_id
    finally:
        srv.stop()  # closes the trackers, flushing them
    run_dir = tmp_path / "data" / "runs" / "tensorboard" / model_id.replace(":", "-")
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx(losses, rel=1e-6)
    assert [e.step for e in events.Scalars("lr")] == [1, 2, 3]
