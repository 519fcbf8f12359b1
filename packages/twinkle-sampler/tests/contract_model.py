"""Test helpers: the contract model every sampler test uses, a peft "trainer", and reference outputs.

Why not TEST_MODEL itself: its weights (std 0.02) make greedy decoding repeat one token forever, so
"greedy equals generate" would prove little; std 0.1 gives varied continuations. head_dim is 32
because vLLM's CPU attention has no kernel for the preset's head_dim of 24.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build_contract_model(folder: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from twinkle.hub import TEST_MODEL, resolve_model_path

    if (folder / "config.json").exists():
        return str(folder)
    base = resolve_model_path(TEST_MODEL)
    config = AutoConfig.from_pretrained(base)
    config.head_dim = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for _, w in model.named_parameters():
                if w.dim() == 2:
                    w.normal_(0, 0.1, generator=g)
    model.generation_config = GenerationConfig.from_pretrained(base)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return str(folder)


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


@torch.no_grad()
def teacher_logprobs(model, prompt: list[int], completion: list[int], adapter: str | None = None) -> list[float]:
    """log p(completion_t | prompt, completion_<t) from one full forward of the trainer (fp32)."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    if adapter is None and hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            logits = model(input_ids=ids).logits
    else:
        if adapter is not None:
            model.set_adapter(adapter)
        logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(prompt) - 1 :].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, adapter: str | None = None) -> list[int]:
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    if adapter is None:
        with model.disable_adapter():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
    else:
        model.set_adapter(adapter)
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()
