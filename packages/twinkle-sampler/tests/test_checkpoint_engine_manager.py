"""twinkle-kit's CheckpointEngineManager over our adapter sync: after a step the sampler samples what
the trainer computes; a sync is a snapshot; what we cannot honour is refused by name."""

from __future__ import annotations

import pytest

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.sampler import SamplingParams, TorchSampler

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _trainer(model_path, adapters=("policy",)):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=model_path)
    for name in adapters:
        model.add_adapter_to_model(name, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
        model.set_optimizer("AdamW", lr=5e-2, adapter_name=name)
    return model


def _train_step(model, prompts):
    rows = [{"input_ids": p + p, "labels": [-100] * len(p) + p} for p in prompts]
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step()


def _trainer_logprobs(model, prompt, completion):
    """The trainer's own log-probs of `completion` after `prompt` (forward_only, no gradient)."""
    row = {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}
    return model.forward_only(inputs=[row])["logprobs"][0][len(prompt) :]


def test_sync_weights_after_a_step_samples_the_trainers_logprobs(model_path, prompts):
    model = _trainer(model_path)
    sampler = TorchSampler(model_path)
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    assert manager.sync_weights(merge_and_sync=False) == 1 and manager.base_sync_done
    assert manager.adapter_name == "policy" and sampler.synced_adapter == "policy"
    base = sampler.compute_logprobs(prompts[:1])
    synced_before = sampler.compute_logprobs(prompts[:1], adapter_name="policy")
    _train_step(model, prompts)
    # a sync is a snapshot: the step reaches the sampler only at the next sync
    assert sampler.compute_logprobs(prompts[:1], adapter_name="policy") == synced_before
    assert manager.sync_weights() == 2 and sampler.weight_version("policy") == 2
    assert sampler.compute_logprobs(prompts[:1], adapter_name="policy") != synced_before
    assert sampler.compute_logprobs(prompts[:1]) == base  # our sample's None stays the base model

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    responses = sampler.sample(prompts[:2], params, adapter_name=manager.adapter_name)
    assert {r.weight_version for r in responses} == {2}
    for prompt, response in zip(prompts, responses):
        sequence = response.sequences[0]
        expected = _trainer_logprobs(model, prompt, sequence.tokens)
        assert len(expected) == len(sequence.logprobs) == 6
        assert max(abs(a - b) for a, b in zip(sequence.logprobs, expected)) < 1e-3


def test_refusals_name_what_is_not_offered(model_path):
    sampler = TorchSampler(model_path)
    with pytest.raises(ValueError, match=r"platform='NPU'"):
        CheckpointEngineManager(model=_trainer(model_path), sampler=sampler, platform="NPU")
    with pytest.raises(NotImplementedError, match="has no LoRA adapter"):
        CheckpointEngineManager(model=_trainer(model_path, adapters=()), sampler=sampler).sync_weights()
    with pytest.raises(ValueError, match=r"holds adapters \['x', 'y'\]"):
        CheckpointEngineManager(model=_trainer(model_path, adapters=("x", "y")), sampler=sampler).sync_weights()
    with pytest.raises(TypeError, match="merge_and_sync='no'"):
        CheckpointEngineManager(model=_trainer(model_path), sampler=sampler).sync_weights(merge_and_sync="no")
    with pytest.raises(KeyError, match="unknown adapter 'nope'"):
        sampler.set_synced_adapter("nope")
