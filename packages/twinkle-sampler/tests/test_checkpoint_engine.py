"""Adapter-only, versioned weight sync: in one process, across torch.distributed ranks, across Ray actors."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from contract_model import teacher_logprobs

from twinkle.checkpoint_engine import InProcessCheckpointEngine, get_checkpoint_engine_class
from twinkle.sampler import SamplingParams, TorchSampler

HERE = Path(__file__).parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def policy(model_path):
    """A real TransformersModel training a LoRA adapter named 'policy'."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=model_path)
    model.add_adapter_to_model("policy", LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    model.set_optimizer("AdamW", lr=5e-2)
    return model


def _train_step(model, prompts):
    rows = [{"input_ids": p + p, "labels": [-100] * len(p) + p} for p in prompts]
    model.forward_backward(inputs=rows, adapter_name="policy")
    model.clip_grad_and_step(adapter_name="policy")


def test_in_process_sync_shares_storage_and_versions(policy, model_path, prompts):
    sampler = TorchSampler(model_path)
    engine = InProcessCheckpointEngine()
    assert engine.sync(policy, sampler, "policy") == 1
    served = sampler.router.adapters["policy"]
    trained = {n: p for n, p in policy.peft_model.named_parameters() if ".policy." in n}
    for module in served.modules:  # zero copy: the sampler's tensors are the trainer's parameters
        assert served.lora_A[module].data_ptr() == trained[f"base_model.model.{module}.lora_A.policy.weight"].data_ptr()
        assert served.lora_B[module].data_ptr() == trained[f"base_model.model.{module}.lora_B.policy.weight"].data_ptr()
    before = sampler.compute_logprobs(prompts[:2], adapter_name="policy")
    _train_step(policy, prompts)
    assert engine.sync(policy, sampler, "policy") == 2
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2)
    response = sampler.sample(prompts[:2], params, adapter_name="policy")
    assert {r.weight_version for r in response} == {2}
    policy.peft_model.eval()
    for prompt, r in zip(prompts, response):  # on-policy: the sampler agrees with the trainer after the step
        expected = teacher_logprobs(policy.peft_model, prompt, r.sequences[0].tokens, "policy")
        assert max(abs(a - b) for a, b in zip(r.sequences[0].logprobs, expected)) < 1e-3
    after = sampler.compute_logprobs(prompts[:2], adapter_name="policy")
    assert after != before


def test_in_process_copy_mode_snapshots(policy, model_path, prompts):
    sampler = TorchSampler(model_path)
    engine = get_checkpoint_engine_class("inprocess")(copy=True)
    engine.sync(policy, sampler, "policy", sampler_adapter_name="snapshot")
    frozen = sampler.compute_logprobs(prompts[:1], adapter_name="snapshot")
    _train_step(policy, prompts)  # the trainer moves on; the snapshot must not
    assert sampler.compute_logprobs(prompts[:1], adapter_name="snapshot") == frozen
    assert engine.sync(policy, sampler, "policy", sampler_adapter_name="snapshot") == 2
    assert sampler.compute_logprobs(prompts[:1], adapter_name="snapshot") != frozen
    assert sampler.weight_version("snapshot") == 2


@pytest.mark.parametrize("kind", ["inprocess", "folder"])
def test_publish_then_apply_serves_the_weights_as_they_were_when_published(policy, model_path, prompts, kind, tmp_path):
    """The two halves of a sync, for a sampler that runs beside the trainer: a published version stays
    what it was while the trainer steps on, and reaches the sampler only when applied."""
    from twinkle.checkpoint_engine import FolderCheckpointEngine

    sampler = TorchSampler(model_path)
    engine = FolderCheckpointEngine(tmp_path) if kind == "folder" else InProcessCheckpointEngine()
    reference = InProcessCheckpointEngine(copy=True)
    reference.sync(policy, sampler, "policy", sampler_adapter_name="reference")
    first = engine.publish(policy, "policy")
    _train_step(policy, prompts)  # after the publish: must not reach what was published
    assert engine.versions["policy"] == 1 and sampler.weight_version("policy") == -1  # nothing applied yet
    assert engine.apply(sampler, "policy", first) == 1 and sampler.weight_version("policy") == 1
    assert sampler.compute_logprobs(prompts[:2], adapter_name="policy") == sampler.compute_logprobs(
        prompts[:2], adapter_name="reference"
    )
    second = engine.publish(policy, "policy")
    assert engine.apply(sampler, "policy", second) == 2
    assert sampler.compute_logprobs(prompts[:2], adapter_name="policy") != sampler.compute_logprobs(
        prompts[:2], adapter_name="reference"
    )
    if kind == "folder":  # folders older than what the sampler serves go at the next publish
        engine.publish(policy, "policy")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2", "policy-v3"]


def test_broadcast_between_two_gloo_ranks(model_path, tmp_path):
    import torch.multiprocessing as mp

    sys.path.insert(0, str(HERE))
    import dist_worker

    # fork: the ranks inherit torch/transformers/peft already imported (spawn re-imports them: ~10 s).
    mp.start_processes(
        dist_worker.run, args=(2, _free_port(), model_path, str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    trainer = json.loads((tmp_path / "rank0.json").read_text())
    sampler = json.loads((tmp_path / "rank1.json").read_text())
    assert trainer["versions"] == sampler["versions"] == [1, 2] and sampler["weight_version"] == 2
    sent, got = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "sampler1.pt")
    assert sent["scaling"] == got["scaling"] and sorted(sent["A"]) == sorted(got["A"])
    for which in ("A", "B"):
        for module in sent[which]:
            assert torch.equal(sent[which][module], got[which][module])  # bit-exact
    assert sampler["greedy"] == trainer["greedy"]


def test_ray_actors_sync_through_the_object_store(model_path, prompts):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'twinkle-mesh[ray]')")
    from twinkle.checkpoint_engine import RayCheckpointEngine

    tests_dir = str(HERE)

    @ray.remote
    class TrainerActor:
        def __init__(self, path):
            sys.path.insert(0, tests_dir)
            import torch as _torch
            from contract_model import make_trainer

            _torch.set_num_threads(1)
            self.model = make_trainer(path, adapters=("policy",))
            self.engine = RayCheckpointEngine()

        def publish_adapter(self, name):
            return self.engine.publish(self.model, name)

        def perturb(self):
            import torch as _torch

            with _torch.no_grad():
                for n, p in self.model.named_parameters():
                    if "lora_B" in n:
                        p.add_(0.05)

        def teacher(self, prompt, tokens):
            from contract_model import teacher_logprobs as tl

            return tl(self.model, prompt, tokens, "policy")

    @ray.remote
    class SamplerActor:
        def __init__(self, path):
            import torch as _torch

            _torch.set_num_threads(1)
            self.sampler = TorchSampler(path)

        def apply_adapter(self, name, payload):
            return RayCheckpointEngine.apply(self.sampler, name, payload)

        def sample(self, prompt):
            r = self.sampler.sample(
                [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=4), adapter_name="policy"
            )
            return r[0].sequences[0].tokens, r[0].sequences[0].logprobs, r[0].weight_version

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer, sampler = TrainerActor.remote(model_path), SamplerActor.remote(model_path)
        engine = RayCheckpointEngine()
        assert engine.sync(trainer, sampler, "policy") == 1
        ray.get(trainer.perturb.remote())
        assert engine.sync(trainer, sampler, "policy") == 2
        tokens, logprobs, version = ray.get(sampler.sample.remote(prompts[0]))
        expected = ray.get(trainer.teacher.remote(prompts[0], tokens))
        assert version == 2 and max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-3
    finally:
        ray.shutdown()
