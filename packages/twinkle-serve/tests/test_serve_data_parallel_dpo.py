"""A DPO batch over two data ranks: the server's Ray group (TrainShard ranks, serve_dp_worker.py) and the
library's data parallelism (TransformersModel, DDP) under torchrun must both give one process's loss and
gradients. A DPO loss is a mean over pairs; the group once weighted each rank by its loss tokens, so with
rank 0 holding long completions and rank 1 short ones its loss and gradient were off by the difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import serve_dp_worker as worker  # the ranks' script: its rows and its reading of an adapter folder

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def init_folder(tmp_path_factory) -> str:
    """A LoRA whose B factors are not zero, so the policy differs from the reference from the first pass."""
    from peft import LoraConfig

    from twinkle.hub import TEST_MODEL
    from twinkle.model.multi_lora import MultiLoraModel

    engine = MultiLoraModel(TEST_MODEL)
    engine.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.adapter_state("default").params:
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return engine.save(tmp_path_factory.mktemp("init") / "adapter")


@pytest.fixture(scope="module")
def ranks(init_folder, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with open(out / "log.txt", "w") as log:
        code = subprocess.run(
            [*command, str(HERE / "serve_dp_worker.py"), init_folder, str(out)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode
    assert code == 0, (out / "log.txt").read_text()[-6000:]
    return json.loads((out / "ranks.json").read_text())


@pytest.fixture(scope="module")
def one_process(init_folder, tmp_path_factory) -> dict:
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL)
    model.load(init_folder)
    model.set_loss("DPOLoss", beta=worker.BETA)
    model.set_optimizer("SGD", lr=1.0)
    loss = model.forward_backward(inputs=worker.dpo_rows())["loss"]
    step = model.clip_grad_and_step(max_grad_norm=None)
    folder = model.save(tmp_path_factory.mktemp("one") / "adapter")
    return {"loss": loss, "grad_norm": step["grad_norm"], "weights": worker.adapter_weights(folder)}


def _step(result: dict, init: dict) -> dict[str, np.ndarray]:
    """What the SGD step (lr 1) moved each adapter tensor by: the gradient."""
    return {name: np.array(init[name]) - np.array(w) for name, w in result["weights"].items()}


def _assert_same_pass(got: dict, want: dict, init: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert set(got["weights"]) == set(want["weights"]) == set(init)
    got_g, want_g = _step(got, init), _step(want, init)
    scale = max(float(np.abs(g).max()) for g in want_g.values())
    assert scale > 1e-3  # the step moved the adapter: a gradient to compare
    for name, g in want_g.items():
        np.testing.assert_allclose(got_g[name], g, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("path", ["server_group", "library"])
def test_a_dpo_batch_over_two_data_ranks_equals_one_process(ranks, one_process, init_folder, path):
    _assert_same_pass(ranks[path], one_process, worker.adapter_weights(init_folder))


def test_the_server_group_and_the_library_agree(ranks, init_folder):
    """The two data-parallel paths against each other (the same ranks, the same shares)."""
    _assert_same_pass(ranks["server_group"], ranks["library"], worker.adapter_weights(init_folder))
