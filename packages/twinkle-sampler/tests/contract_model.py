"""The model every contract test samples from: TEST_MODEL's tokenizer and architecture, re-initialised.

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
