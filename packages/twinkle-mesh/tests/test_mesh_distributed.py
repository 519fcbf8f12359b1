"""Real processes: one torchrun launch (2 ranks, gloo: DDP, FSDP2, tensor parallel) and one Ray
cluster (a 2-actor remote group), each checked against the one-process run of the same steps.
The Ray tests come first: the torchrun launch runs in the background meanwhile."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twinkle.mesh as tm
from twinkle.mesh import runtime as rt_module

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _load_steps():
    # Loaded from its file (not from sys.path), as no Ray worker could import it by name: this is
    # also what makes the remote group ship LoraTrainer to the actors by value.
    if "mesh_steps" not in sys.modules:
        spec = importlib.util.spec_from_file_location("mesh_steps", HERE / "mesh_steps.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["mesh_steps"] = module
        spec.loader.exec_module(module)
    return sys.modules["mesh_steps"]


steps = _load_steps()


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(2)
    losses, lora = steps.train_reference()
    return {"losses": losses, "lora": lora, "tp": steps.tp_steps()}


# Two ranks all-reduce gradients in another order than one process: fp32 losses agree relative to
# their magnitude, and LoRA weights (~1e-2 after 3 steps) to far below what a lost update moves (>1e-2).
LOSS_RTOL = 1e-5


def _assert_lora_close(got: dict, want: dict, atol: float):
    assert sorted(got) == sorted(want) and len(want) == 28  # 2 layers x 7 linears x (A, B)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= atol, f"LoRA weights differ by {worst}"


@pytest.fixture(scope="module", autouse=True)
def torchrun_launch(request, tmp_path_factory):
    """Started before anything else in this module and left running in the background: the launch
    overlaps the reference run and the Ray tests, which only wait on it when they need it."""
    if not any("torchrun_result" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None  # no torchrun test selected (-k): no launch
        return
    folder = tmp_path_factory.mktemp("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(HERE / "mesh_steps.py"),
                str(folder / "result.pt"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield proc, folder
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def torchrun_result(torchrun_launch):
    proc, folder = torchrun_launch
    code = proc.wait(timeout=600)
    assert code == 0, (folder / "log.txt").read_text()[-8000:]
    return torch.load(folder / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def ray_trainer():
    ray = pytest.importorskip("ray")
    rt_module._RUNTIME = None
    tm.initialize(mode="ray", groups=[tm.DeviceGroup("model", 2, "cpu")], seed=42)
    trainer = steps.LoraTrainer(device_mesh=tm.DeviceMesh.from_sizes(dp_size=2), parallel="ddp", remote_group="model")
    yield trainer
    tm.shutdown()  # stops the group's actors and disconnects from Ray
    assert tm.get_runtime() is None and not ray.is_initialized()


def test_ray_remote_group_matches_the_local_run(ray_trainer, reference):
    rows = steps.make_rows()
    losses = [
        ray_trainer.train_step(rows[i * steps.GLOBAL_BATCH : (i + 1) * steps.GLOBAL_BATCH]) for i in range(steps.STEPS)
    ]
    assert losses == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    _assert_lora_close(ray_trainer.lora_state(), reference["lora"], atol=1e-5)


@pytest.mark.no_float
def test_ray_remote_group_fans_out_and_collects(ray_trainer, capsys):
    ranks = ray_trainer.whoami()
    assert [(r["rank"], r["data_rank"], r["world"], r["threads"]) for r in ranks] == [(0, 0, 2, 1), (1, 1, 2, 1)]
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3  # two actor processes, not this one
    rows = steps.make_rows(5)
    assert ray_trainer.row_lengths(rows, extra=1) == [len(r["input_ids"]) + 1 for r in rows]  # slice + flatten
    assert ray_trainer.row_count(rows) == 2.5  # slices of 3 and 2, mean
    assert ray_trainer.train_step.__name__ == "train_step"  # names and signatures kept
    text = tm.get_device_placement()
    assert "group 'model': 2 x cpu, devices [0, 1]" in text
    assert "LoraTrainer rank 1: node" in text and str(ranks[1]["pid"]) in text
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        ray_trainer.nope  # noqa: B018


@pytest.mark.no_float
def test_ray_remote_failure_names_the_rank_and_carries_the_traceback(ray_trainer):
    with pytest.raises(tm.RemoteError, match="LoraTrainer.fail_on_rank failed on rank 1 of remote group 'model'") as e:
        ray_trainer.fail_on_rank(1)
    assert e.value.rank == 1 and e.value.exc_type == "ValueError"
    assert "deliberate failure on rank 1" in str(e.value)
    assert 'mesh_steps.py", line' in e.value.remote_traceback and "in fail_on_rank" in e.value.remote_traceback
    assert ray_trainer.fail_on_rank(5) == "ok"  # the group survives a failed call


class FailsToBuildOnRank1(metaclass=tm.RemoteClass):
    def __init__(self, device_mesh=None):
        if tm.get_global_mesh().rank == 1:
            raise RuntimeError("no room on rank 1")


@pytest.mark.no_float
def test_a_second_component_shares_the_group_and_a_failed_build_names_the_rank(ray_trainer):
    with pytest.raises(tm.RemoteError, match=r"FailsToBuildOnRank1\(\) failed on rank 1 .*no room on rank 1"):
        FailsToBuildOnRank1(remote_group="model")  # colocated with the trainer on 'model'
    assert "FailsToBuildOnRank1" not in tm.get_device_placement(print_it=False)  # its actors are gone
    with pytest.raises(ValueError, match=r"unknown remote_group 'sampler'.*\['model'\]"):
        FailsToBuildOnRank1(remote_group="sampler")
    with pytest.raises(ValueError, match=r"dp=3 .* do not match the size of DeviceGroup 'model' 2"):
        FailsToBuildOnRank1(device_mesh=tm.DeviceMesh.from_sizes(dp_size=3), remote_group="model")


def test_ray_killed_rank_is_named_and_the_group_rebuilds_fresh(ray_trainer, reference):
    """kill -9 of one actor: the next call fails with WorkerDied naming the rank and its pid; the
    rebuilt group has new actors built as the first ones were (the first step equals a fresh run's)."""
    import signal

    pids = [r["pid"] for r in ray_trainer.whoami()]
    assert ray_trainer.remote_pids() == pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(
        tm.WorkerDied,
        match=rf"LoraTrainer.whoami failed: rank 1 of remote group 'model' died "
        rf"\(pid {pids[1]} on node ",
    ) as died:
        ray_trainer.whoami()
    assert died.value.rank == 1 and isinstance(died.value, tm.RemoteError)
    ray_trainer.remote_rebuild()
    fresh = [r["pid"] for r in ray_trainer.whoami()]
    assert len(set(fresh)) == 2 and not set(fresh) & set(pids)
    rows = steps.make_rows()
    assert ray_trainer.train_step(rows[: steps.GLOBAL_BATCH]) == pytest.approx(reference["losses"][0], rel=LOSS_RTOL)


def test_torchrun_initializes_gloo_with_global_and_per_rank_seeds(torchrun_result):
    r = torchrun_result
    assert (r["world"], r["backend"]) == (2, "gloo")
    assert [(x["rank"], x["data_rank"], x["rank_seed"]) for x in r["ranks"]] == [(0, 0, 7), (1, 1, 8)]
    assert r["ranks"][0]["draw"] == r["ranks"][1]["draw"]  # the global seed: identical draws
    assert r["torch_mesh_dims"] == ("pp", "dp", "fsdp", "cp", "tp")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_data_parallel_matches_one_process(torchrun_result, reference, strategy):
    got = torchrun_result[strategy]
    assert got["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    _assert_lora_close(got["lora"], reference["lora"], atol=1e-5)
    moved = max(
        (w - reference["lora"][n]).abs().max().item() for n, w in steps.lora_weights(steps.build_model()).items()
    )
    # it does train: 3 steps moved the weights far beyond the tolerance (the losses are of 3 different
    # batches of random tokens, so whether they fall says nothing)
    assert moved > 1e-2


def test_torchrun_tensor_parallel_matches_one_process(torchrun_result, reference):
    got, want = torchrun_result["tp"], reference["tp"]
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-4)
    assert (got["q_proj0"] - want["q_proj0"]).abs().max().item() <= 1e-4
