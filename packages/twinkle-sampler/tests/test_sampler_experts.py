"""The sampler serves every adapter the trainer saves on MoE families: expert LoRA (3-D weights) and
attention LoRA, trained by MultiLoraModel, saved as a peft folder, loaded into a TorchSampler, whose
greedy tokens and log-probs match the trainer's own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

from twinkle.model.families import tiny_model
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.experts import MultiLoraExperts
from twinkle.model.structure import describe
from twinkle.sampler import SamplingParams, TorchSampler, load_adapter_folder

torch.set_num_threads(2)
PROMPTS = [[5, 17, 33, 90, 4], [7, 7, 120, 61]]


def train(family):
    base = tiny_model(family)
    trainer = MultiLoraModel(model=copy.deepcopy(base))
    experts = describe(base).expert_parameters("experts")
    trainer.add_adapter_to_model(
        "t", LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=experts)
    )
    trainer.set_optimizer("AdamW", adapter_name="t", lr=5e-2)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 250, (4, 10), generator=g).tolist()]
    for _ in range(3):
        trainer.forward_backward(rows, "t")
        trainer.clip_grad_and_step(adapter_name="t")
    return base, trainer


def trainer_logprobs(trainer, prompt, completion):
    out = trainer.forward_only([{"input_ids": prompt + completion, "labels": prompt + completion}], "t")
    return out["logprobs"][0][len(prompt) :]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_sampler_generates_with_the_saved_expert_adapter(family, tmp_path):
    base, trainer = train(family)
    trainer.save(tmp_path / "t", "t")
    sampler = TorchSampler(model=copy.deepcopy(base))
    sampler.load_adapter("t", tmp_path / "t")
    assert any(isinstance(m, MultiLoraExperts) for m in sampler.model.modules())
    params = SamplingParams(max_tokens=6, temperature=0)
    tuned = sampler.sample(PROMPTS, params, adapter_name=["t", "t"])
    plain = sampler.sample(PROMPTS, params, adapter_name=[None, None])
    base_lp = []
    for prompt, response, untuned in zip(PROMPTS, tuned, plain):
        seq = response.sequences[0]
        expected = trainer_logprobs(trainer, prompt, seq.tokens)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4
        # greedy: each sampled token is the trainer's argmax after the tokens before it
        for t in range(len(seq.tokens)):
            logits = trainer.logits([{"input_ids": prompt + seq.tokens[:t]}], "t")
            assert int(logits[0, -1].argmax()) == seq.tokens[t]
        base_lp.append(untuned.sequences[0].logprobs)
    # the adapter matters: without it the sampler's own log-probs differ
    trained = [r.sequences[0].logprobs for r in tuned]
    assert any(abs(a - b) > 1e-2 for x, y in zip(trained, base_lp) for a, b in zip(x, y))
    sampler.remove_adapter("t")
    assert not any(isinstance(m, MultiLoraExperts) for m in sampler.model.modules())


def test_folder_expert_factors_are_resolved_to_their_weights(tmp_path):
    base, trainer = train("qwen3_moe")
    trainer.save(tmp_path / "t", "t")
    weights = load_adapter_folder(tmp_path / "t")
    nested = [m for m in weights.modules if m.endswith("experts.base_layer")]
    assert len(nested) == 2 and weights.scaling[nested[0]] == 2.0  # alpha 8 / r 4, not / (experts * r)
    sampler = TorchSampler(model=copy.deepcopy(base))
    sampler.set_adapter("t", weights)
    for name, factors in trainer.expert_factors("t").items():
        module, _, param = name.rpartition(".")
        served = sampler.model.get_submodule(module).factors("t", param)
        assert torch.equal(served.a, factors.a) and torch.equal(served.b, factors.b)


def test_expert_adapter_of_a_peft_model_is_served_with_its_log_probs():
    from peft import get_peft_model

    from twinkle.sampler import extract_adapter

    base = tiny_model("gpt_oss")
    experts = describe(base).expert_parameters("experts")
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, target_modules=["o_proj"], target_parameters=experts)
    )
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3, generator=g)
    weights = extract_adapter(peft_model, "default")
    assert sorted(weights.meta["target_parameters"]) == sorted(experts)
    sampler = TorchSampler(model=copy.deepcopy(base))
    sampler.set_adapter("p", weights)
    ids = PROMPTS[0] + [40, 41, 42]
    served = sampler.compute_logprobs([ids], adapter_name="p")[0][1:]
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    assert max(abs(a - b) for a, b in zip(served, expected.tolist())) < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sampler_loads_what_transformers_model_saves_with_expert_lora(family, tmp_path):
    """TransformersModel (peft's ParamWrapper on the experts) trains, saves; the sampler serves the folder."""
    from twinkle.model import TransformersModel

    tiny_model(family).save_pretrained(tmp_path / "base")
    tm = TransformersModel(str(tmp_path / "base"))
    experts = describe(tm.hf_model).expert_parameters("experts")
    tm.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], target_parameters=experts))
    tm.set_optimizer("AdamW", lr=5e-2)
    ids = PROMPTS[0] + [40, 41, 42, 43]
    for _ in range(3):
        tm.forward_backward([{"input_ids": ids, "labels": ids}])
        tm.clip_grad_and_step()
    tm.save(tmp_path / "a")
    sampler = TorchSampler(model=tiny_model(family))
    sampler.load_adapter("a", tmp_path / "a")
    assert sum(isinstance(m, MultiLoraExperts) for m in sampler.model.modules()) == len(experts) // 2
    served = sampler.compute_logprobs([ids], adapter_name="a")[0][1:]
    plain = sampler.compute_logprobs([ids])[0][1:]
    trained = tm.forward_only([{"input_ids": ids, "labels": ids}])["logprobs"][0][1:]
    assert max(abs(a - b) for a, b in zip(served, trained)) < 1e-4
    assert max(abs(a - b) for a, b in zip(served, plain)) > 1e-2
