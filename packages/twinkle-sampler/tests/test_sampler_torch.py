"""TorchSampler specifics: per-row adapters in one batch, batching independence, inputs, errors."""

from __future__ import annotations

import pytest
import torch
from contract_model import teacher_logprobs

from twinkle.sampler import (
    AdapterWeights,
    SamplingParams,
    TorchSampler,
    extract_adapter,
    get_sampler_class,
    load_adapter_folder,
)
from twinkle.sampler.decoding import filter_logits


@pytest.fixture(scope="module")
def sampler(model_path, trainer):
    s = TorchSampler(model_path)
    for name in ("tenant", "other"):
        s.set_adapter(name, extract_adapter(trainer, name), version=1)
    return s


def test_rows_with_different_adapters_in_one_batch(sampler, trainer, prompts):
    rows = [prompts[0], prompts[1], prompts[0], prompts[3]]
    adapters = [None, "tenant", "other", "tenant"]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    mixed = sampler.sample(rows, params, adapter_name=adapters)
    for row, adapter, response in zip(rows, adapters, mixed):
        alone = sampler.sample([row], params, adapter_name=adapter)[0].sequences[0]
        seq = response.sequences[0]
        assert response.adapter_name == adapter and seq.tokens == alone.tokens
        expected = teacher_logprobs(trainer, row, seq.tokens, adapter)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-3
    # The same prompt under the base and another adapter: different distributions.
    assert max(abs(a - b) for a, b in zip(mixed[0].sequences[0].logprobs, mixed[2].sequences[0].logprobs)) > 0.05


def test_seeded_output_does_not_depend_on_batch(sampler, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, num_samples=2)
    batched = sampler.sample(prompts, params)
    alone = sampler.sample([prompts[2]], params)[0]
    assert [s.tokens for s in batched[2].sequences] == [s.tokens for s in alone.sequences]


def test_truncation_reduces_to_greedy(sampler, prompts):
    greedy = sampler.sample(prompts, SamplingParams(max_tokens=6, temperature=0))
    top1 = sampler.sample(prompts, SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=3))
    nucleus = sampler.sample(prompts, SamplingParams(max_tokens=6, temperature=0.7, top_p=1e-6, seed=3))
    tokens = lambda rs: [r.sequences[0].tokens for r in rs]  # noqa: E731
    assert tokens(top1) == tokens(greedy) == tokens(nucleus)


def test_filter_logits_keeps_exactly_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(top_p=5e-324) == [True, False, False, False]  # 0 in float32: still the top token
    coldest = filter_logits(logits, SamplingParams(temperature=5e-324)).softmax(dim=-1)  # likewise: not 0/0
    assert coldest[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_logprobs_and_no_logprobs(sampler, prompts):
    seq = sampler.sample([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].sequences[0]
    assert all(len(step) == 3 for step in seq.top_logprobs)
    for tok, lp, step in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
        assert step[0][0] == tok and abs(step[0][1] - lp) < 1e-6  # greedy: the sampled token is the top one
        assert step[0][1] >= step[1][1] >= step[2][1]
    bare = sampler.sample([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=False))[0]
    assert bare.sequences[0].logprobs is None and bare.sequences[0].tokens == seq.tokens


def test_input_forms_agree(sampler, tokenizer, prompts):
    params = SamplingParams(max_tokens=5, temperature=0)
    want = sampler.sample([prompts[1]], params)[0].sequences[0].tokens
    forms = [
        prompts[1],
        {"input_ids": prompts[1]},
        torch.tensor(prompts[1]),
        [torch.tensor(prompts[1])],
        "the quick brown fox jumps over",
    ]
    for form in forms:
        assert sampler.sample(form, params)[0].sequences[0].tokens == want, form


def test_chat_inputs_go_through_the_template(model_path):
    template_mod = pytest.importorskip("twinkle.template", reason="twinkle-data's Template is not installed")
    template = template_mod.Template(model_id=model_path, max_length=256)
    sampler = TorchSampler(model_path, template=template)
    messages = [{"role": "user", "content": "what is 1+1?"}]
    prompt = template.encode_prompt(messages)["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0)
    for form in (messages, {"messages": messages}, [{"messages": messages}]):
        response = sampler.sample(form, params)[0]
        assert response.prompt_tokens == prompt
    assert (
        sampler.sample(messages, params)[0].sequences[0].tokens
        == sampler.sample([prompt], params)[0].sequences[0].tokens
    )


def test_saved_peft_folder_serves_the_same_adapter(sampler, trainer, tmp_path):
    trainer.save_pretrained(tmp_path, selected_adapters=["tenant"])
    version = sampler.load_adapter("from_disk", tmp_path / "tenant" if (tmp_path / "tenant").exists() else tmp_path)
    loaded, live = sampler.router.adapters["from_disk"], extract_adapter(trainer, "tenant")
    assert loaded.modules == live.modules and version == 1
    for m in live.modules:
        assert torch.equal(loaded.lora_A[m], live.lora_A[m]) and torch.equal(loaded.lora_B[m], live.lora_B[m])
        assert loaded.scaling[m] == live.scaling[m]
    sampler.remove_adapter("from_disk")
    assert "from_disk" not in sampler.adapter_names


@pytest.mark.no_float
def test_bad_inputs_are_clear_errors(sampler, trainer, model_path):
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown SamplingParams fields \\['beam'\\]"):
        SamplingParams.from_dict({"beam": 2})
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.sample([[]])
    with pytest.raises(ValueError, match="adapter_name lists 1 names for 2 prompts"):
        sampler.sample([[1, 2], [3]], adapter_name=["tenant"])
    with pytest.raises(TypeError, match="plain base model"):
        TorchSampler(model=trainer)
    wrong = AdapterWeights(
        {"model.layers.0.self_attn.q_proj": torch.zeros(2, 5)},
        {"model.layers.0.self_attn.q_proj": torch.zeros(7, 2)},
        {"model.layers.0.self_attn.q_proj": 1.0},
    )
    with pytest.raises(ValueError, match="do not fit Linear"):
        sampler.set_adapter("wrong", wrong)
    with pytest.raises(KeyError, match="no LoRA adapter named 'nope'.*'other', 'tenant'"):
        extract_adapter(trainer, "nope")


@pytest.mark.no_float
def test_registry_finds_the_samplers():
    assert get_sampler_class("TorchSampler") is TorchSampler
    with pytest.raises(KeyError, match="unknown sampler 'Nope'"):
        get_sampler_class("Nope")


@pytest.mark.no_float
def test_load_adapter_folder_rejects_non_adapters(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        load_adapter_folder(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gathered by the gpu session)")
def test_cuda_sampler_matches_the_trainer_on_the_same_device(model_path, prompts):
    from contract_model import hf_greedy, make_trainer

    trainer = make_trainer(model_path).to("cuda")
    sampler = TorchSampler(model_path, device="cuda")
    sampler.set_adapter("tenant", extract_adapter(trainer, "tenant"))
    for adapter in (None, "tenant"):
        greedy = sampler.sample(prompts, SamplingParams(max_tokens=12, temperature=0), adapter_name=adapter)
        assert [r.sequences[0].tokens for r in greedy] == [hf_greedy(trainer, p, 12, adapter) for p in prompts]
        sampled = sampler.sample(prompts, SamplingParams(max_tokens=8, seed=1), adapter_name=adapter)
        for prompt, r in zip(prompts, sampled):
            expected = teacher_logprobs(trainer, prompt, r.sequences[0].tokens, adapter)
            assert max(abs(a - b) for a, b in zip(r.sequences[0].logprobs, expected)) < 1e-3
