"""Crash-exact RL resume: a GRPO run killed with SIGKILL at random points and resumed from its newest
checkpoint ends with the adapter bit for bit as an uninterrupted run of the same seed.

The run is examples/grpo_async.py at `--max-staleness 0`, the synchronous loop (every batch is sampled
with the weights that train on it), on the tiny model. Bit-exact is the right bar here, not a
tolerance: both runs execute the same kernels on the same shapes in the same order on one machine
with one thread, so any difference is state the checkpoint lost (optimizer moments, the data
position, a sampling seed, the sampler's weights or version, the queue).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from twinkle.hub import TEST_MODEL
from twinkle.rl.checkpoint import RLState, latest_rl_checkpoint, save_rl_checkpoint

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_async.py"
STEPS = 8


def _command(tmp: Path, name: str, resume: bool) -> list[str]:
    args = ["--model", TEST_MODEL, "--warm-start-steps", "0", "--steps", str(STEPS), "--prompts", "2"]
    args += ["--group", "4", "--max-tokens", "4", "--max-staleness", "0", "--eval-prompts", "4"]
    args += ["--eval-every", "1000", "--threads", "1", "--checkpoint-every", "1", "--seed", "3"]
    args += ["--checkpoint-dir", str(tmp / name), "--save", str(tmp / f"{name}-final"), "--plot", str(tmp / "p.png")]
    return [sys.executable, str(EXAMPLE), *args, *(["--resume"] if resume else [])]


def _start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _kill_after(proc: subprocess.Popen, step: int, delay: float) -> str:
    """SIGKILL `proc` `delay` seconds after it reports step `step` (mid-checkpoint or mid-step)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {step}: reward"):
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    return "".join(seen)


def _finish(proc: subprocess.Popen) -> str:
    out = proc.communicate()[0]
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_grpo_killed_twice_and_resumed_ends_bit_identical(tmp_path):
    plain = _start(_command(tmp_path, "plain", resume=False))  # beside the crashing run: two cores
    rng = random.Random(46)
    first, second = rng.randint(2, 4), rng.randint(5, STEPS - 1)
    _kill_after(_start(_command(tmp_path, "crash", resume=False)), first, rng.uniform(0.0, 0.1))
    out = _kill_after(_start(_command(tmp_path, "crash", resume=True)), second, rng.uniform(0.0, 0.1))
    # the kill lands mid-step or mid-checkpoint: the run goes on from the newest complete checkpoint
    assert first - 1 <= int(re.search(r"resumed from step-(\d+)", out)[1]) < second
    out = _finish(_start(_command(tmp_path, "crash", resume=True)))
    assert second - 1 <= int(re.search(r"resumed from step-(\d+)", out)[1]) < STEPS
    _finish(plain)

    crashed = load_file(str(tmp_path / "crash-final" / "adapter_model.safetensors"))
    uninterrupted = load_file(str(tmp_path / "plain-final" / "adapter_model.safetensors"))
    assert sorted(crashed) == sorted(uninterrupted)
    assert any(v.abs().max() > 0 for k, v in uninterrupted.items() if "lora_B" in k)  # it trained
    different = [k for k in uninterrupted if not torch.equal(crashed[k], uninterrupted[k])]
    assert not different, f"{len(different)} of {len(uninterrupted)} tensors differ, e.g. {different[:3]}"


class CountingModel:
    """What save_rl_checkpoint needs of a model: `save` writing a folder (a kill lands inside it)."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at

    def save(self, path, adapter_name=None, save_training_state=False, data_position=None):
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_model.safetensors").write_text(str(data_position))
        if data_position == self.fail_at:
            raise KeyboardInterrupt  # the process dies mid-save


def test_a_checkpoint_cut_short_is_never_the_latest(tmp_path):
    assert latest_rl_checkpoint(tmp_path / "none") is None
    for step in (1, 2, 3):
        save_rl_checkpoint(tmp_path, CountingModel(), "policy", RLState(step=step, policy_version=step + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]  # keep=2
    with pytest.raises(KeyboardInterrupt):
        save_rl_checkpoint(tmp_path, CountingModel(fail_at=4), "policy", RLState(step=4))
    assert (tmp_path / "step-000004.partial").is_dir()
    assert latest_rl_checkpoint(tmp_path).name == "step-000003"
