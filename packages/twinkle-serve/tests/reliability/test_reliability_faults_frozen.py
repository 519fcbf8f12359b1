"""A frozen worker: the server's model group is 2 Ray actors (a local Ray the server starts; the server
runs in this process so the test can see the actors' pids), and one of them is stopped with SIGSTOP --
not killed -- while a heavy forward_backward is in flight. Checked:

- the request fails after `ray.call_timeout_s` with an error naming the stopped rank, its pid and
  node, and saying it was stopped (never an endless wait);
- the group is rebuilt with fresh actors (the stopped process is gone); the request queued behind
  it says its adapter went with the group;
- nothing acknowledged is lost: the tenant resumes from its last checkpoint (weights and optimizer)
  and its next step's loss equals the one it took from there before the freeze; the checkpoint is
  still listed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest
from harness import SUMMARY

pytest.importorskip("ray")

TIMEOUT_S = 5.0
SEQS = [[5 + (3 * i + k) % 60 for i in range(17)] for k in range(4)]


def _datum(tokens):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train_group():
    import twinkle.mesh

    (group,) = [g for g in twinkle.mesh.get_runtime().remote_groups["model"] if "TrainShard" in repr(g)]
    return group


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process, in clock ticks (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _stop_once_computing(pid: int, ticks: int = 5, within_s: float = 60.0) -> None:
    """SIGSTOP `pid` as soon as it has burnt `ticks` more CPU ticks than now (50 ms at the usual 100 Hz):
    the pass has reached it. A fixed sleep instead stopped it before the pass arrived on a slow machine
    and after the pass had finished on a fast one."""
    start, deadline = _cpu_ticks(pid), time.monotonic() + within_s
    while _cpu_ticks(pid) - start < ticks:
        assert time.monotonic() < deadline, f"rank pid {pid} never started computing"
        time.sleep(0.002)
    os.kill(pid, signal.SIGSTOP)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_sigstopped_actor_times_out_naming_it_and_tenants_resume(tmp_path, caplog):
    import tinker
    from tinker import types

    import twinkle.serve as ts
    from twinkle.hub import TEST_MODEL

    config = {
        "ray": {"groups": [{"name": "model", "ranks": 2, "device_type": "cpu"}], "call_timeout_s": TIMEOUT_S},
        "models": [{"name": TEST_MODEL, "remote_group": "model"}],
    }
    caplog.set_level(logging.WARNING, logger="twinkle.serve")
    srv = ts.initialize(port=0, data_dir=tmp_path, config=config, block=False, log_level="warning").wait_ready()
    stopped = None
    try:
        key = srv.create_key("frozen")
        service = tinker.ServiceClient(base_url=srv.url, api_key=key)
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=3).result()
        batch, adam = [_datum(s) for s in SEQS], types.AdamParams(learning_rate=5e-2)
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
        acked = tc.save_state("acked").result().path  # the last acknowledged checkpoint
        after_acked = tc.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(adam).result()

        group = _train_group()
        old_pids, old_nodes = group.remote_pids(), group.remote_node_ids()
        heavy = [_datum([5 + (3 * i + k) % 60 for i in range(120)]) for k in range(48)]  # ~1 s of compute
        stopped = old_pids[1]
        in_flight = tc.forward_backward(heavy, "cross_entropy")
        queued = tc.optim_step(adam)
        _stop_once_computing(stopped)
        t0 = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as frozen:
            in_flight.result(timeout=120)
        waited = time.monotonic() - t0
        message = str(frozen.value)
        assert f"did not answer within {TIMEOUT_S:g} s" in message, message
        assert f"rank 1 (pid {stopped} on node" in message and ", stopped)" in message, message
        assert "resume from the last checkpoint" in message, message
        with pytest.raises(tinker.RequestFailedError, match="timed out.*resume from the last checkpoint"):
            queued.result(timeout=120)

        # rebuilt: fresh actors; the stopped process was killed, not left behind
        assert not set(group.remote_pids()) & set(old_pids) and set(group.remote_node_ids()) == set(old_nodes)
        deadline = time.monotonic() + 30
        while not _gone(stopped) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(stopped), f"the stopped actor {stopped} is still there"
        stopped = None

        resumed = service.create_training_client_from_state_with_optimizer(acked).result()
        loss = resumed.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
        assert loss == pytest.approx(after_acked, rel=1e-5)  # the same step from the same state
        assert resumed.optim_step(adam).result().metrics["grad_norm:mean"] > 0
        rest = tinker.RestClient(base_url=srv.url, api_key=key)
        assert acked in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    finally:
        if stopped is not None:  # the test failed before the rebuild: never leave a stopped process
            os.kill(stopped, signal.SIGKILL)
        srv.stop()
    rebuilt = [float(m) for m in re.findall(r"remote group rebuilt in ([0-9.]+) s", caplog.text)]
    assert len(rebuilt) == 1, caplog.text[-2000:]
    print(
        f"\nfrozen worker: SIGSTOP of rank 1 (pid {old_pids[1]}) mid-pass; the request failed {waited:.1f} s later "
        f"(call_timeout_s {TIMEOUT_S:g} s, then the group's rebuild {rebuilt[0]:.1f} s, under load)"
    )
    SUMMARY["frozen worker (SIGSTOP of a Ray actor mid-pass)"] = (
        f"timed out at {TIMEOUT_S:g} s naming rank, pid, node; answered after the rebuild ({waited:.1f} s in all); "
        "resumed from checkpoint with the same next loss"
    )
