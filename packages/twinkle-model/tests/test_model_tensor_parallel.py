"""TransformersModel with tp=2 under real torchrun (gloo, CPU, fp32, qwen3-tiny): LoRA and
full-parameter, tp alone (2 ranks, also with the ChunkedCrossEntropy head) and with dp or fsdp
(4 ranks), against the same steps (unpatched) in this process. model_tp_worker.py runs the scenarios; a launch starts when its first test needs it and
runs in the background while this process computes the one-process reference.
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
TOL = 1e-5  # fp32 reduction order: observed differences are ~5e-7 (losses) and ~5e-8 (weights)


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


tp_worker = _load("model_tp_worker")
worker = tp_worker.load_dist_worker()
CASES = [(world, *scenario) for world, scenarios in tp_worker.SCENARIOS.items() for scenario in scenarios]
IDS = [case[1] for case in CASES]


class Launches:
    """One torchrun launch per world size, started on first use, awaited on first result."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def start(self, world: int) -> None:
        if world in self.procs:
            return
        folder = self.root / f"world{world}"
        folder.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(folder / "log.txt", "w") as log:
            self.procs[world] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={world}",
                    str(HERE / "model_tp_worker.py"),
                    str(folder),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def ranks(self, world: int) -> tuple[list[dict], Path]:
        self.start(world)
        folder = self.root / f"world{world}"
        code = self.procs[world].wait(timeout=900)
        assert code == 0, (folder / "log.txt").read_text()[-8000:]
        return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)], folder

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    runs = Launches(tmp_path_factory.mktemp("torchrun"))
    runs.start(min(tp_worker.SCENARIOS))  # overlaps the first reference computation
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from twinkle.mesh import DeviceMesh

    folder, cache = tmp_path_factory.mktemp("reference"), {}

    def get(gas: int, lora: bool) -> dict:
        if (gas, lora) not in cache:
            torch.set_num_threads(2)
            cache[gas, lora] = worker.run_scenario(
                None, gas, DeviceMesh.from_sizes(dp_size=1), folder / f"{gas}{lora}", lora=lora
            )
        return cache[gas, lora]

    return get


def _worst(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max((torch.tensor(got[n]) - torch.tensor(want[n])).abs().max().item() for n in want)


@pytest.mark.parametrize("world,name,sizes,gas,lora,patch", CASES, ids=IDS)
def test_losses_grad_norms_and_weights_match_one_process(launches, reference, world, name, sizes, gas, lora, patch):
    ref = reference(gas, lora)
    ranks, _ = launches.ranks(world)
    got = ranks[0][name]
    assert len(got["losses"]) == worker.STEPS * gas and got["stepped"] == ref["stepped"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert all(r[name]["losses"] == got["losses"] for r in ranks)
    # the norm of the full gradients (tp shards and fsdp shards together), not of this rank's pieces
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TOL, abs=TOL)
    assert len(got["weights"]) == (28 if lora else 24)  # 2 layers x 7 linears x (A, B); every model weight
    assert _worst(got["weights"], ref["weights"]) <= TOL
    assert all(r[name]["weights"] == got["weights"] for r in ranks)  # gathered: every rank sees the same model
    # this rank's data slice of a forward_only batch after training: the log-probs of the same rows
    want = ref["logprobs"][: len(got["logprobs"])]
    assert len(got["logprobs"]) == worker.GLOBAL_MICRO_BATCH // sizes.get("dp_size", 1) // sizes.get("fsdp_size", 1)
    assert _worst(dict(enumerate(got["logprobs"])), dict(enumerate(want))) <= TOL
    assert _moved(got["weights"], lora) > 100 * TOL  # it trained: the comparison is not of untouched weights


def _moved(weights: dict, lora: bool) -> float:
    """How far the weights are from where training started (LoRA B starts at zero)."""
    if lora:
        return max(torch.tensor(v).abs().max().item() for n, v in weights.items() if "lora_B" in n)
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path

    start = dict(
        AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32).named_parameters()
    )
    return max((torch.tensor(v) - start[n]).abs().max().item() for n, v in weights.items())


def _tp(placements: list[str]) -> str:
    return placements[-1]  # tp is the fastest mesh dim: its placement comes last


@pytest.mark.parametrize("world,name,sizes,gas,lora,patch", CASES, ids=IDS)
def test_projections_are_sharded_and_lora_follows_its_base_layer(launches, world, name, sizes, gas, lora, patch):
    layout = launches.ranks(world)[0][0][name]["layout"]
    hidden, q_width, mlp, r = 96, 4 * 24, 192, 4
    if lora:
        assert len(layout) == 28
        q, o, down = (
            f"base_model.model.model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")
        )
        assert _tp(layout[f"{q}.lora_B.default.weight"][0]) == "Shard(dim=0)"  # colwise base: B colwise
        assert _tp(layout[f"{q}.lora_A.default.weight"][0]) == "Replicate()"  # ... A replicated
        assert _tp(layout[f"{o}.lora_A.default.weight"][0]) == "Shard(dim=1)"  # rowwise base: A rowwise
        assert _tp(layout[f"{o}.lora_B.default.weight"][0]) == "Replicate()"  # ... B replicated
        if sizes.get("fsdp_size", 1) == 1:
            assert layout[f"{q}.lora_B.default.weight"][1] == [q_width // 2, r]
            assert layout[f"{down}.lora_A.default.weight"][1] == [r, mlp // 2]
    else:
        layer = "model.layers.1"
        expect = {
            f"{layer}.self_attn.k_proj.weight": "Shard(dim=0)",
            f"{layer}.mlp.up_proj.weight": "Shard(dim=0)",
            f"{layer}.self_attn.o_proj.weight": "Shard(dim=1)",
            f"{layer}.mlp.down_proj.weight": "Shard(dim=1)",
            f"{layer}.self_attn.q_norm.weight": "Replicate()",
            "model.embed_tokens.weight": "Replicate()",
        }
        assert {n: _tp(layout[n][0]) for n in expect} == expect
        if sizes.get("fsdp_size", 1) == 1:
            assert layout[f"{layer}.self_attn.o_proj.weight"][1] == [hidden, q_width // 2]
        else:  # fsdp shards dim 0 on top of tp
            assert layout[f"{layer}.mlp.up_proj.weight"][1] == [mlp // 4, hidden]


@pytest.mark.parametrize("world,name,sizes,gas,lora,patch", CASES, ids=IDS)
def test_save_writes_the_full_gathered_weights(launches, world, name, sizes, gas, lora, patch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path

    ranks, folder = launches.ranks(world)
    base = resolve_model_path(TEST_MODEL)
    if lora:
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(folder / name)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder / name), dtype=torch.float32)
    params = dict(model.named_parameters())
    for n, values in ranks[0][name]["weights"].items():  # full shapes, exactly what the run trained
        assert torch.equal(params[n], torch.tensor(values)), n


def test_an_adapter_added_after_the_first_forward_is_placed_and_trains_like_one_process(launches):
    from twinkle.mesh import DeviceMesh

    got = launches.ranks(2)[0][0]["two-adapters"]
    torch.set_num_threads(2)
    want = tp_worker.two_adapters(DeviceMesh.from_sizes(dp_size=1))
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL)
    assert len(want["b"]) == 12 and _worst(got["b"], want["b"]) <= TOL  # 2 layers x 3 targets x (A, B)
    assert _worst(got["a"], want["a"]) <= TOL and _moved(got["b"], lora=True) > 100 * TOL
