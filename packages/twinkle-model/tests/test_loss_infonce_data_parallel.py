"""InfonceLoss's in-batch negatives over two torchrun processes (gloo, DDP, LoRA, task='embedding') equal
one process over the whole batch: the reported loss and the synchronised gradients; the model's
ddp_config reaches DDP."""

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
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def _worker():
    spec = importlib.util.spec_from_file_location("infonce_dist_worker", HERE / "infonce_dist_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_processes_equal_one_over_the_whole_batch(tmp_path):
    worker = _worker()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [*TORCHRUN, str(HERE / "infonce_dist_worker.py"), str(tmp_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        from twinkle.mesh import DeviceMesh

        one = worker.step(DeviceMesh.from_sizes(dp_size=1), slice(None))  # while the ranks run
        assert proc.wait(timeout=600) == 0, (tmp_path / "log.txt").read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["find_unused"] is True  # ddp_config reached DistributedDataParallel
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert rank["grads"].keys() == one["grads"].keys()
        for name, grad in one["grads"].items():
            torch.testing.assert_close(torch.tensor(rank["grads"][name]), torch.tensor(grad), rtol=1e-4, atol=1e-7)
    assert any(any(g != 0 for g in grad) for grad in one["grads"].values())
