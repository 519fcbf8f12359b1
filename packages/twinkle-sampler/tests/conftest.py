"""Shared fixtures: the contract model, a peft "trainer" with two LoRA adapters, teacher-forced log-probs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # helper modules beside the tests (importlib mode)
from contract_model import build_contract_model, make_trainer

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


@pytest.fixture(scope="session")
def trainer(model_path):
    return make_trainer(model_path)
