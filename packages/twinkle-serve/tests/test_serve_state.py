"""Checkpoints: save/load state, resume trajectories, listing and deletion, and a restart on the same data dir."""

from __future__ import annotations

import pytest

from twinkle.hub import TEST_MODEL

SEQ = [7 + (5 * i) % 70 for i in range(20)]


def _step(tc, sft, types):
    fb = tc.forward_backward([sft(SEQ)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.05))
    return fb.result().metrics["loss:sum"]


def test_resume_with_optimizer_continues_the_same_trajectory(alice, sft):
    from tinker import types

    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=5, train_unembed=False).result()
    for _ in range(2):
        _step(tc, sft, types)
    path = tc.save_state("mid").result().path
    assert path == f"tinker://{tc.model_id}/weights/mid"
    continued = [_step(tc, sft, types) for _ in range(2)]

    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != tc.model_id
    assert [_step(resumed, sft, types) for _ in range(2)] == pytest.approx(continued, rel=1e-5)
    # weights only: the first step matches (same weights), the second differs (fresh Adam moments)
    fresh = alice.create_training_client_from_state(path).result()
    fresh_losses = [_step(fresh, sft, types) for _ in range(2)]
    assert fresh_losses[0] == pytest.approx(continued[0], rel=1e-5)
    assert fresh_losses[1] != pytest.approx(continued[1], rel=1e-4)
    info = tinker_rest(alice).get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.lora_rank, info.train_unembed, info.train_mlp) == (TEST_MODEL, 4, False, True)


def tinker_rest(service_client):
    return service_client.create_rest_client()


def test_checkpoints_are_listed_and_deleted(alice, sft):
    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    tc.save_state("a").result()
    tc.save_weights_for_sampler("b").result()
    rest = tinker_rest(alice)
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type) for c in listed} == {
        ("weights/a", "training"),
        ("sampler_weights/b", "sampler"),
    }
    assert all(c.size_bytes > 0 for c in listed)
    run = rest.get_training_run(tc.model_id).result()
    assert run.lora_rank == 2 and run.last_checkpoint.checkpoint_id == "weights/a"
    rest.delete_checkpoint(tc.model_id, "weights/a").result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["sampler_weights/b"]
    with pytest.raises(Exception, match="not found|404"):
        alice.create_training_client_from_state(f"tinker://{tc.model_id}/weights/a").result()
    runs = rest.list_training_runs(limit=100).result()
    assert tc.model_id in {r.training_run_id for r in runs.training_runs}
    assert runs.cursor.total_count >= 1


def test_restart_keeps_runs_and_checkpoints(tmp_path, start, sft):
    import tinker
    from tinker import types

    srv = start(tmp_path)
    key = srv.create_key("dora")
    client = tinker.ServiceClient(base_url=srv.url, api_key=key)
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2).result()
    _step(tc, sft, types)
    path = tc.save_state("before").result().path
    sampler_path = tc.save_weights_for_sampler("samp").result().path
    expected = tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    run_id = tc.model_id
    srv.stop()

    srv = start(tmp_path)  # same data dir, same key
    try:
        client = tinker.ServiceClient(base_url=srv.url, api_key=key)
        rest = client.create_rest_client()
        assert run_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        assert {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints} == {path, sampler_path}
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            expected, rel=1e-5
        )
        lps = (
            client.create_sampling_client(model_path=sampler_path)
            .result()
            .compute_logprobs(types.ModelInput.from_ints(SEQ))
            .result()
        )
        assert -sum(lps[1:]) == pytest.approx(expected, rel=1e-4)
    finally:
        srv.stop()
