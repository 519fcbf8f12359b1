"""A MoE base model (`twinkle://qwen3-moe-tiny`) through the unmodified Tinker SDK: train_mlp trains the
experts (expert LoRA in the fused engine), the loss falls, the sampler serves the trained adapter with
the trainer's log-probs, and get_info names the real architecture."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub.embedded_moe import MOE_TEST_MODEL

SEQ = [5 + (7 * i) % 60 for i in range(20)]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, start):
    srv = start(tmp_path_factory.mktemp("moe-data"), models=[{"name": MOE_TEST_MODEL}])
    yield srv
    srv.stop()


def test_tinker_loop_on_a_moe_model_trains_the_experts(moe_server, sft):
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=moe_server.url, api_key=moe_server.create_key("mo"))
    tc = client.create_lora_training_client(
        base_model=MOE_TEST_MODEL, rank=4, seed=1, train_attn=False, train_unembed=False
    ).result()  # the experts alone: every layer of this model is sparse, so train_mlp is expert LoRA only
    assert tc.get_info().model_data.arch == "qwen3_moe"
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([sft(SEQ)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.9 * losses[0], losses
    sampler = tc.save_weights_and_get_sampling_client().result()
    served = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()
    trained = tc.forward([sft(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(served[1:], dtype=np.float32), trained, atol=2e-5)
    out = sampler.sample(types.ModelInput.from_ints(SEQ[:5]), 1, types.SamplingParams(max_tokens=3)).result()
    assert len(out.sequences[0].tokens) == 3


@pytest.mark.parametrize("train_attn", [False, True])
def test_adapter_memory_counts_expert_factors_as_peft_builds_them(train_attn):
    """The server's adapter-memory estimate of a train_mlp LoRA on a MoE model covers the expert
    factors: it equals four copies (weights, grads, two Adam moments) of what peft allocates."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path
    from twinkle.serve.backend import LoraSpec
    from twinkle.serve.core.adapter_memory import AdapterMemory

    class _Backend:  # what the estimate reads from a backend
        base_module = AutoModelForCausalLM.from_pretrained(resolve_model_path(MOE_TEST_MODEL))

    spec = LoraSpec(rank=4, train_attn=train_attn, train_unembed=False)
    estimate = AdapterMemory(None).estimate(_Backend(), spec)
    base = _Backend.base_module
    config = LoraConfig(
        r=4, target_modules=spec.target_modules(base), target_parameters=spec.target_parameters(base) or None
    )
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model_path(MOE_TEST_MODEL)), config)
    lora = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    experts = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n and "experts" in n)
    assert experts > 0 and estimate == lora * 4 * 4, (estimate, lora, experts)
