"""twinkle-kit's CheckpointEngineManager with the trainer in a Ray group (`ray_group` in conftest.py): the
adapter reaches the sampler through a folder in the checkpoint format, and the sampler then scores what
the trained group scores."""

from __future__ import annotations

import pytest

from twinkle.hub import TEST_MODEL
from twinkle.sampler import TorchSampler

pytestmark = pytest.mark.slow
ROWS = [
    {"input_ids": list(range(5 + i, 14 + 2 * i)), "labels": [-100] * 2 + list(range(7 + i, 14 + 2 * i))}
    for i in range(4)
]


def test_sync_weights_from_a_ray_group_serves_the_trained_adapter(ray_group, tmp_path):
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.model import TransformersModel

    remote = TransformersModel(model_id=TEST_MODEL, device_mesh=ray_group, remote_group="model")
    remote.add_adapter_to_model("policy", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    remote.set_optimizer("AdamW", lr=5e-2)
    sampler = TorchSampler(model_id=TEST_MODEL)
    manager = CheckpointEngineManager(model=remote, sampler=sampler, checkpoint_dir=tmp_path)
    assert manager.sync_weights(merge_and_sync=False) == 1 and sampler.synced_adapter == "policy"
    for _ in range(2):
        remote.forward_backward(inputs=ROWS)
        remote.clip_grad_and_step()
    assert manager.sync_weights(merge_and_sync=False) == 2 and sampler.weight_version("policy") == 2
    trained = remote.forward_only(inputs=ROWS)["logprobs"]
    served = sampler.compute_logprobs([r["input_ids"] for r in ROWS], adapter_name="policy")
    base = sampler.compute_logprobs([r["input_ids"] for r in ROWS])
    # forward_only's log-probs are 0 where labels are -100: compare the labelled positions (2 on)
    worst = max(abs(a - b) for t, s in zip(trained, served) for a, b in zip(t[2:], s[2:]))
    moved = max(abs(a - b) for t, s in zip(trained, base) for a, b in zip(t[2:], s[2:]))
    assert worst < 1e-4 < moved  # the trained adapter, not the base
    remote.remote_shutdown()
