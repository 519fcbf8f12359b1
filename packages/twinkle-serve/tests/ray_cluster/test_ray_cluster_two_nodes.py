"""The server's model group across a real two-node Ray cluster (one actor per node), driven by the
Tinker SDK and the native client: the numbers equal a server running everything in process. Then one
actor is killed with SIGKILL mid-step: the request in flight fails naming the dead worker, the group
is rebuilt (still across both nodes), the tenants' later requests say their adapter is gone, and
each tenant resumes from its last acknowledged checkpoint with nothing acknowledged lost.

Heavy (two `ray start`s, two servers): run by `nox -s ray_cluster`, not by the serve session."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL

sys.path.insert(0, str(Path(__file__).parents[1]))
from _remote_runs import (
    SEQS,
    assert_native_runs_equal,
    native_model,
    native_steps,
    run_native_loop,
    run_tinker_loop,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(two_nodes, start, tmp_path_factory):
    local = start(tmp_path_factory.mktemp("local"))
    remote = None
    try:
        remote = start(
            tmp_path_factory.mktemp("two-nodes"),
            ray={"address": two_nodes, "groups": [{"name": "model", "ranks": 2, "placement": "spread"}]},
            models=[{"name": TEST_MODEL, "remote_group": "model"}],
        )
        yield remote, local
    finally:
        if remote is not None:
            remote.stop()
        local.stop()


def train_group():
    import twinkle.mesh

    (group,) = [g for g in twinkle.mesh.get_runtime().remote_groups["model"] if "TrainShard" in repr(g)]
    return group


def test_model_group_has_one_actor_on_each_node(servers):
    import ray

    group = train_group()
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and set(group.remote_node_ids()) == nodes  # rank 0 and rank 1 on different nodes
    assert os.getpid() not in group.remote_pids()


def test_two_node_remote_runs_equal_local(servers, sft):
    remote, local = servers
    got, expected = run_tinker_loop(remote, sft), run_tinker_loop(local, sft)
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert got["grad_norm_after_failure"] == pytest.approx(expected["grad_norm_after_failure"], rel=1e-5)
    assert got["forward_loss"] == pytest.approx(expected["forward_loss"], rel=1e-5)
    assert got["probe_logprobs"][1:] == pytest.approx(expected["probe_logprobs"][1:], abs=1e-4)
    assert_native_runs_equal(run_native_loop(remote), run_native_loop(local))


def test_remote_actor_killed_mid_step_rebuilds_and_tenants_resume(servers, sft):
    import tinker
    from tinker import types

    from twinkle.client import TwinkleClient, TwinkleRequestFailed

    remote, _ = servers
    batch = [sft(s) for s in SEQS]
    adam = types.AdamParams(learning_rate=5e-2)
    key = remote.create_key("kill-tinker")
    tinker_client = tinker.ServiceClient(base_url=remote.url, api_key=key)
    tc = tinker_client.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=3).result()
    for _ in range(2):
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
    acked = tc.save_state("acked").result().path  # the last acknowledged checkpoint
    step3 = tc.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(adam).result()
    native = TwinkleClient(remote.url, remote.create_key("kill-native"))
    model = native_model(native)
    native_steps(model, 1)
    native_acked = model.save("native-acked", save_training_state=True).result()
    native_step2 = native_steps(model, 1)

    group = train_group()
    old_pids, old_nodes = group.remote_pids(), group.remote_node_ids()
    heavy = [sft([5 + (3 * i + k) % 60 for i in range(120)]) for k in range(48)]  # ~1 s: the kill lands mid-pass
    in_flight = tc.forward_backward(heavy, "cross_entropy")
    queued = tc.optim_step(adam)
    os.kill(old_pids[1], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as died:
        in_flight.result()
    message = str(died.value)
    assert f"rank 1 of remote group 'model' died (pid {old_pids[1]} on node" in message, message
    assert "resume from the last checkpoint" in message
    with pytest.raises(tinker.RequestFailedError, match="remote group 'model' died.*resume from the last checkpoint"):
        queued.result()  # queued behind it: its adapter went with the group
    with pytest.raises(TwinkleRequestFailed, match="remote group 'model' died.*resume from the last checkpoint"):
        model.forward_backward(inputs=[{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}]).result()

    # rebuilt: fresh actors, still one per node
    assert not set(group.remote_pids()) & set(old_pids) and set(group.remote_node_ids()) == set(old_nodes)
    # nothing acknowledged is lost: each tenant resumes from its checkpoint and the next step is the
    # one it took from there before the kill
    resumed = tinker_client.create_training_client_from_state_with_optimizer(acked).result()
    assert resumed.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        step3, rel=1e-6
    )
    assert resumed.optim_step(adam).result().metrics["grad_norm:mean"] > 0
    again = native_model(native)
    again.resume_from_checkpoint(native_acked).result()
    assert native_steps(again, 1) == native_step2
    rest = tinker.RestClient(base_url=remote.url, api_key=key)
    assert acked in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
