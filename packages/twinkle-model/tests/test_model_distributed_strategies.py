"""TransformersModel under real torchrun (2 ranks, gloo, CPU, fp32, LoRA): DDP and FSDP2, with and
without gradient accumulation, against the same steps in this process on the whole global batch.

One torchrun launch runs every scenario (model_dist_worker.py); it starts first and runs in the
background while this process computes the one-process reference.
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


def _load_worker():
    # From its file: the tests folder is not a package and its name must not clash with other members'.
    if "model_dist_worker" not in sys.modules:
        spec = importlib.util.spec_from_file_location("model_dist_worker", HERE / "model_dist_worker.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_dist_worker"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_dist_worker"]


worker = _load_worker()
NAMES = [f"{s}-gas{g}" for s, g in worker.SCENARIOS]


@pytest.fixture(scope="module", autouse=True)
def launch(tmp_path_factory):
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
                str(HERE / "model_dist_worker.py"),
                str(folder),
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
def ranks(launch):
    proc, folder = launch
    code = proc.wait(timeout=600)
    assert code == 0, (folder / "log.txt").read_text()[-8000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)], folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from twinkle.mesh import DeviceMesh

    torch.set_num_threads(2)
    folder = tmp_path_factory.mktemp("reference")
    one = DeviceMesh.from_sizes(dp_size=1)
    # the strategy does not matter in one process: the model runs unwrapped
    return {
        g: worker.run_scenario("ddp", g, one, folder / f"gas{g}") for g in sorted({g for _, g in worker.SCENARIOS})
    }, folder


def _gas(name: str) -> int:
    return int(name.rsplit("gas", 1)[1])


@pytest.mark.parametrize("name", NAMES)
def test_global_micro_batch_loss_and_grad_norm_match_one_process(ranks, reference, name):
    (r0, r1), _ = ranks
    ref = reference[0][_gas(name)]
    assert len(r0[name]["losses"]) == worker.STEPS * _gas(name)
    assert r0[name]["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert r1[name]["losses"] == r0[name]["losses"]  # every rank reports the global micro-batch loss
    assert r0[name]["stepped"] == ref["stepped"] == ([False] * (_gas(name) - 1) + [True]) * worker.STEPS
    assert r0[name]["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL)
    assert max(ref["grad_norms"]) > 0.5  # gradients of real size (and clipping at 1.0 is exercised)


def test_fsdp_size_alone_selects_fsdp2_and_ddp_on_an_fsdp_mesh_is_refused(ranks):
    (r0, r1), _ = ranks
    for name in ("fsdp2-gas1", "fsdp2-gas2"):
        assert r0[name]["strategy"] == r1[name]["strategy"] == "fsdp2"
        assert r0[name]["wrapped"].startswith("FSDP")  # fully_shard's class swap, not DDP
        assert all(placements == ["Shard(dim=0)"] for placements, _ in r0[name]["layout"].values())
    assert r0["ddp-gas1"]["wrapped"] == "DistributedDataParallel" and not r0["ddp-gas1"]["layout"]
    assert "strategy='ddp' replicates the model" in r0["ddp-on-fsdp-mesh"]
    assert "fsdp_size=2" in r0["ddp-on-fsdp-mesh"] and "strategy='fsdp2'" in r0["ddp-on-fsdp-mesh"]


@pytest.mark.parametrize("name", NAMES)
def test_lora_weights_match_one_process_after_three_steps(ranks, reference, name):
    (r0, r1), _ = ranks
    got, want = r0[name]["weights"], reference[0][_gas(name)]["weights"]
    assert sorted(got) == sorted(want) and len(want) == 28  # 2 layers x 7 linears x (A, B)
    worst = max((torch.tensor(got[n]) - torch.tensor(want[n])).abs().max().item() for n in want)
    assert worst <= TOL, f"{name}: LoRA weights differ from the one-process run by {worst}"
    assert r1[name]["weights"] == got  # the ranks hold the same model
    assert max(torch.tensor(want[n]).abs().max().item() for n in want if "lora_B" in n) > 0.05  # it trained


@pytest.mark.parametrize("name", NAMES)
def test_gradients_sync_only_on_accumulation_boundaries(ranks, name):
    (r0, r1), _ = ranks
    gas = _gas(name)
    for i, (p0, p1) in enumerate(zip(r0[name]["probes"], r1[name]["probes"])):
        boundary = (i + 1) % gas == 0
        if boundary:  # reduced: every rank holds the same (averaged) gradient
            assert p0["has_grad"] and p0["digest"] == p1["digest"], (i, p0, p1)
        elif name.startswith("ddp"):  # each rank still holds the gradient of its own rows only
            assert p0["has_grad"] and p1["has_grad"] and abs(p0["digest"] - p1["digest"]) > 1e-4, (i, p0, p1)
        else:  # FSDP2 keeps unsharded gradients to itself: no reduce-scatter into the sharded .grad yet
            assert not p0["has_grad"] and not p1["has_grad"], (i, p0, p1)


@pytest.mark.parametrize("name", NAMES)
def test_distributed_save_is_an_ordinary_peft_folder(ranks, reference, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path

    (r0, _), folder = ranks
    saved = folder / name
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == resolve_model_path(TEST_MODEL)

    def load(path):
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
        return PeftModel.from_pretrained(base, str(path)).eval()

    loaded = load(saved)
    params = dict(loaded.named_parameters())
    for n, values in r0[name]["weights"].items():  # exactly what the distributed run trained
        assert torch.equal(params[n], torch.tensor(values)), n
    ids = torch.tensor([worker.make_rows(1)[0]["input_ids"]])
    with torch.no_grad():
        ours = loaded(input_ids=ids).logits
        ref = load(reference[1] / f"gas{_gas(name)}")(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= TOL
