"""Context parallelism on the torch backend under real torchrun (gloo, CPU, fp32, LoRA): cp=2 on 2
ranks and dp=2 x cp=2 on 4 ranks, against the same steps in this process on the whole batch.

Both launches start first and run in the background while this process computes the reference.
The rows (model_dist_worker's) have uneven lengths up to 16: right padding, cut into shards of 8.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
TOL = 1e-5
LAUNCHES = {"cp2": (2, 2), "dp2xcp2": (4, 2)}  # name: (processes, cp_size)


def _load(name: str):
    # From its file: the tests folder is not a package and its name must not clash with other members'.
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


worker = _load("model_cp_worker")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = {}
    for name, (nproc, cp) in LAUNCHES.items():
        folder = tmp_path_factory.mktemp(name)
        with open(folder / "log.txt", "w") as log:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            cmd += [str(HERE / "model_cp_worker.py"), str(folder), str(cp)]
            procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), folder, nproc)
    yield procs
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(launches):
    from twinkle.mesh import DeviceMesh

    one = DeviceMesh.from_sizes(dp_size=1)
    out = {"train": worker.dist_worker().run_scenario("ddp", 1, one), "grads": worker.first_gradients(one)}
    return {**out, **{p: worker.dist_worker().run_scenario("ddp", 1, one, patch=p) for p in worker.PATCHES}}


@pytest.fixture(scope="module")
def ranks(launches, reference):  # the reference first: it runs while the launches do
    out = {}
    for name, (proc, folder, nproc) in launches.items():
        code = proc.wait(timeout=600)
        assert code == 0, (folder / "log.txt").read_text()[-8000:]
        out[name] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)]
    return out


def _worst(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max((torch.tensor(got[n]) - torch.tensor(want[n])).abs().max().item() for n in want)


@pytest.mark.parametrize("name", LAUNCHES)
def test_losses_and_gradients_equal_one_process(ranks, reference, name):
    want = reference["train"]
    for r, got in enumerate(ranks[name]):
        assert got["train"]["losses"] == pytest.approx(want["losses"], abs=TOL), r
        assert got["train"]["grad_norms"] == pytest.approx(want["grad_norms"], abs=TOL), r
        assert _worst(got["grads"], reference["grads"]) <= TOL, f"{name} rank {r}: gradients differ"
    assert max(abs(x) for v in reference["grads"].values() for x in torch.tensor(v).flatten().tolist()) > 0.01


@pytest.mark.parametrize("name", LAUNCHES)
def test_lora_weights_and_logprobs_equal_one_process(ranks, reference, name):
    want = reference["train"]
    for r, got in enumerate(ranks[name]):
        assert _worst(got["train"]["weights"], want["weights"]) <= TOL, f"{name} rank {r}"
    # forward_only: the cp peers gather the whole rows; data ranks return their own rows
    rows = [row for got in ranks[name][:: LAUNCHES[name][1]] for row in got["train"]["logprobs"]]
    assert [len(r) for r in rows] == [len(r) for r in want["logprobs"]] == [6, 13, 9, 16]
    assert max(abs(a - b) for x, y in zip(rows, want["logprobs"]) for a, b in zip(x, y)) <= TOL
    assert ranks[name][0]["train"]["logprobs"] == ranks[name][1]["train"]["logprobs"]  # cp peers agree


@pytest.mark.parametrize("patch", worker.PATCHES)
def test_activation_checkpointing_and_the_chunked_head_under_cp_equal_one_process(ranks, reference, patch):
    want = reference[patch]
    for name in LAUNCHES:
        got = ranks[name][0][patch]
        assert got["losses"] == pytest.approx(want["losses"], abs=TOL), name
        assert _worst(got["weights"], want["weights"]) <= TOL, name


def test_what_context_parallelism_cannot_do_is_refused_by_name(ranks):
    refused = ranks["cp2"][0]["refusals"]
    assert "context parallelism needs right padding" in refused["left_padding"]
    assert "left padding or holes" in refused["left_padding"]
    assert "does not implement packed rows" in refused["packed"]
    assert refused["dpo"].startswith("DPOLoss reads whole sequences") and "use cp_size=1" in refused["dpo"]


def test_cp_with_fsdp_or_tp_is_refused():
    from twinkle.mesh import DeviceMesh
    from twinkle.model.strategy import resolve_strategy

    for sizes in (dict(fsdp_size=2, cp_size=2), dict(tp_size=2, cp_size=2)):
        with pytest.raises(ValueError, match=r"implements context parallelism \(cp_size=2\) with dp \(DDP\) only"):
            resolve_strategy(None, DeviceMesh.from_sizes(dp_size=1, **sizes))
    assert resolve_strategy(None, DeviceMesh.from_sizes(dp_size=2, cp_size=2)) == "ddp"
