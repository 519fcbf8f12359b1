"""Shared fixtures: the contract model, a peft "trainer" with two LoRA adapters, teacher-forced log-probs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # helper modules beside the tests (importlib mode)
from contract_model import build_contract_model  # noqa: E402

torch.set_num_threads(2)

PROMPT_TEXTS = ["hello world", "the quick brown fox jumps over", "1+1=", "Twinkle is a"]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    return build_contract_model(tmp_path_factory.mktemp("contract-model"))


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]


def make_trainer(model_path: str, adapters=("tenant", "other")):
    """A peft model with LoRA adapters whose B is non-zero (init_lora_weights=False), so they matter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = None
    for i, name in enumerate(adapters):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=8, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    # Tame the random B so adapters change the output without blowing the logits up.
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.3)
    return peft_model.eval()


@pytest.fixture(scope="session")
def trainer(model_path):
    return make_trainer(model_path)


@torch.no_grad()
def teacher_logprobs(model, prompt: list[int], completion: list[int], adapter: str | None = None) -> list[float]:
    """log p(completion_t | prompt, completion_<t) from one full forward of the trainer (fp32)."""
    ids = torch.tensor([prompt + completion])
    if adapter is None and hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            logits = model(input_ids=ids).logits
    else:
        if adapter is not None:
            model.set_adapter(adapter)
        logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(prompt) - 1:].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, adapter: str | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    if adapter is None:
        with model.disable_adapter():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False)
    else:
        model.set_adapter(adapter)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
