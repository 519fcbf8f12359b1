"""The server scaled out on Ray: the training model and the sampler as twinkle.mesh remote groups.

One local Ray cluster for the module (started by the server from its `ray` config section): the
model group has 2 CPU actors (data parallel), and the sampler is colocated on the same group (two
replicas, requests round robin). Driven by the unmodified tinker SDK, it must give the same losses,
log-probs and samples as a server with everything in one process; so must a native client (its
adapter's token-mean loss, gradient accumulation, scheduler, metrics, save and resume).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
from _remote_runs import SEQS, assert_native_runs_equal, run_native_loop, run_tinker_loop

RAY_CONFIG = {
    "ray": {"groups": [{"name": "model", "ranks": 2, "device_type": "cpu"}]},
    "models": [{"name": TEST_MODEL, "remote_group": "model", "sampler_remote_group": "model"}],
}


@pytest.fixture(scope="module")
def ray_server(start, tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("serve-ray"), **RAY_CONFIG)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def local_server(start, tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("serve-local"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def runs(ray_server, local_server, sft):
    return run_tinker_loop(local_server, sft), run_tinker_loop(ray_server, sft)


def test_native_training_on_a_remote_group_equals_local(ray_server, local_server):
    """Native (twinkle-client) training on a base model whose model group is 2 Ray actors (data
    parallel, uneven row and loss-token splits) gives the in-process server's numbers."""
    assert_native_runs_equal(run_native_loop(ray_server), run_native_loop(local_server))


def test_model_and_sampler_run_as_ray_actor_groups(ray_server, runs):
    import twinkle.mesh

    placement = twinkle.mesh.get_device_placement(print_it=False)
    assert "mode=ray" in placement
    train = [line for line in placement.splitlines() if "TrainShard rank" in line]
    samplers = [line for line in placement.splitlines() if "SamplerShard rank" in line]
    assert len(train) == 2 and len(samplers) == 2, placement
    pids = {line.split(" pid ")[1].split()[0] for line in train + samplers}
    assert len(pids) == 4, placement  # four actor processes, none of them this one
    assert str(__import__("os").getpid()) not in pids


def test_data_parallel_losses_equal_one_process(runs):
    expected, got = runs
    assert got["losses"][-1] < got["losses"][0]
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
    assert got["grad_norm_after_failure"] == pytest.approx(expected["grad_norm_after_failure"], rel=1e-5)
    assert got["forward_loss"] == pytest.approx(expected["forward_loss"], rel=1e-5)
    assert [len(lp) for lp in got["logprobs"]] == [len(s) - 1 for s in SEQS]  # datum order kept
    for g, e in zip(got["logprobs"], expected["logprobs"]):
        # Two shards reduce gradients in another order than one process, so the trained weights and
        # the log-probs read from them agree relative to their magnitude (fp32), not bit for bit.
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_remote_sampler_matches_local_sampler(runs):
    expected, got = runs
    assert got["probe_logprobs"][0] is None
    np.testing.assert_allclose(
        np.array(got["probe_logprobs"][1:], dtype=np.float32),
        np.array(expected["probe_logprobs"][1:], dtype=np.float32),
        atol=1e-4,
    )
    first, second = got["samples"]
    assert [s[0] for s in first] == [s[0] for s in second]  # seeded: same on either replica
    assert [s[0] for s in first] == [s[0] for s in expected["samples"][0]]
    for tokens, logprobs, _ in first:
        assert len(tokens) == len(logprobs) == 5 and all(lp <= 0 for lp in logprobs)
    assert got["alt_tokens"].shape == (5, 3)  # a prompt table reduced on a sampler rank
    assert got["alt_tokens"].tolist() == expected["alt_tokens"].tolist()
    np.testing.assert_allclose(got["alt_logprobs"], expected["alt_logprobs"], atol=1e-4)


def test_bad_request_fails_alone_and_training_goes_on(runs, sft):
    from tinker import types

    _, got = runs
    tc = got["tc"]
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10**7]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(Exception, match="outside the vocabulary"):
        tc.forward_backward([sft(SEQS[0]), bad], "cross_entropy").result()
    # nothing from the failed request reached any rank's gradients: a clean step still works
    fb = tc.forward_backward([sft(s) for s in SEQS], "cross_entropy").result()
    assert np.isfinite(fb.metrics["loss:sum"])
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ray": {"groups": [{"name": "model", "ranks": 2, "gpus": 1}]}}, "gpus"),
        ({"ray": {"groups": [{"name": "model", "ranks": 2}], "adress": "auto"}}, "adress"),
        ({"ray": {"groups": []}}, "groups"),
        ({"ray": {"groups": [{"name": "a", "ranks": 1}, {"name": "a", "ranks": 2}]}}, "unique"),
        ({"models": [{"name": TEST_MODEL, "remote_group": "model"}], "ray": None}, "needs a `ray` section"),
        ({"models": [{"name": TEST_MODEL, "sampler_remote_group": "gpu"}]}, "not one of ray.groups"),
        ({"models": [{"name": TEST_MODEL, "remote_group": "model", "backend": "peft"}]}, "multi_lora"),
    ],
)
@pytest.mark.no_float
def test_ray_config_is_validated(change, message):
    from twinkle.serve.config import ServeConfig

    with pytest.raises(ValueError, match=message):
        ServeConfig.model_validate({**RAY_CONFIG, **change})


def test_state_saved_from_the_ranks_resumes_on_them(runs, sft):
    """save_state gathers rank 0's LoRA and AdamW moments; loading puts them on every rank: the
    resumed model's next step equals the original's."""
    from tinker import types

    _, got = runs
    tc = got["tc"]
    path = tc.save_state("ray-resume").result().path
    resumed = got["client"].create_training_client_from_state_with_optimizer(path).result()
    batch = [sft(s) for s in SEQS]
    steps = []
    for c in (tc, resumed):
        fb = c.forward_backward(batch, "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        steps.append((fb.metrics["loss:sum"], c.forward(batch, "cross_entropy").result().metrics["loss:sum"]))
    assert steps[1] == pytest.approx(steps[0], rel=1e-6)


def _ratio_loss(logprobs, advantages):
    import torch

    ratio = torch.exp(logprobs - logprobs.detach())
    return -(ratio * advantages).sum(), {"custom/adv:mean": advantages.mean(), "custom/n:sum": advantages.sum() * 0 + 1}


def _custom_loss_step(server) -> dict:
    """One server-side custom-loss forward_backward and an optim_step; the loss and metrics, then a forward's
    log-probs on the stepped weights. Four datums of different lengths and advantages: the two ranks' slices
    are uneven and each datum's inputs must travel with its slice."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_key("custom-dp"))
    handle = client.create_custom_loss(_ratio_loss, {"logprobs": 1, "advantages": 1}).result()
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=21).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={
                "target_tokens": s[1:],
                "advantages": types.TensorData(data=[0.5 - k] * (len(s) - 1), dtype="float32", shape=[len(s) - 1]),
            },
        )
        for k, s in enumerate(SEQS)
    ]
    out = tc.forward_backward_custom(data, handle).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward(data, "cross_entropy").result()
    return {"metrics": out.metrics, "logprobs": [o["logprobs"].to_numpy() for o in after.loss_fn_outputs]}


def test_a_custom_loss_on_data_parallel_ranks_equals_one_process(ray_server, local_server):
    expected, got = _custom_loss_step(local_server), _custom_loss_step(ray_server)
    assert got["metrics"].keys() == expected["metrics"].keys()
    assert got["metrics"]["custom/n:sum"] == len(SEQS)  # summed over the ranks' datums, as the SDK sums it
    for key, value in expected["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for g, e in zip(got["logprobs"], expected["logprobs"], strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
