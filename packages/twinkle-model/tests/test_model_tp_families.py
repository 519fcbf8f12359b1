"""tp=2 (torchrun, gloo, CPU, fp32) equals one process on every family the tp planner accepts;
the families it refuses are refused by name at construction (test_model_structure)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # one torchrun launch (2 ranks)
spec = importlib.util.spec_from_file_location("model_tp_family_worker", HERE / "model_tp_family_worker.py")
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tpfam")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run([*cmd, str(HERE / "model_tp_family_worker.py"), str(folder)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def _close(a, b):
    if isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y)
    else:
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("family", worker.PLANNED)
def test_tp2_equals_one_process(ranks, family):
    import twinkle.mesh as tm

    one = worker.train(family, tm.DeviceMesh.from_sizes(dp_size=1))
    for rank in ranks:
        assert rank[family]["sharded"] >= 2 * 7  # q/k/v/o/gate/up/down of both layers at least
        _close(one["losses"], rank[family]["losses"])
        _close(one["logprobs"], rank[family]["logprobs"])
