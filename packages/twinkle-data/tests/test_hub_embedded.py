"""The embedded default models: offline, deterministic, loaded like any checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.hub import DEFAULT_MODEL, TEST_MODEL, OfflineError, embedded_path, resolve_model_path
from twinkle.hub.embedded import ASSETS

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "build_assets.py"
# sha256 over every tensor (name, dtype, shape, bytes) in sorted order. A change here means the
# embedded weights changed for everyone: a new torch/transformers init, or an edited preset.
PINNED_WEIGHTS = {
    "qwen3-tiny": "72666c4e610617bfbfb551fdf12306d2b1d54c416042e9c09771c99c6c7fc227",
}


def weights_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name, t in sorted(load_file(folder / "model.safetensors").items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build_assets_module():
    spec = importlib.util.spec_from_file_location("build_assets", TOOLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_fresh_builds_are_bit_identical_and_match_the_pin(tmp_path, monkeypatch):
    folders = []
    for cache in ("a", "b"):
        monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / cache))
        folders.append(embedded_path(TEST_MODEL))
    a, b = folders
    assert a != b and a.name == b.name
    assert weights_digest(a) == weights_digest(b) == PINNED_WEIGHTS["qwen3-tiny"]
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")], "staging folder left behind"


def test_building_leaves_the_callers_rng_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    embedded_path(TEST_MODEL)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("model_id, low, high", [(TEST_MODEL, 1e5, 5e5), (DEFAULT_MODEL, 4e6, 6e6)])
def test_loads_through_from_pretrained_like_any_checkpoint(model_id, low, high):
    path = resolve_model_path(model_id)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert low < sum(p.numel() for p in model.parameters()) < high
    assert model.config.vocab_size == len(tokenizer) == 850
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_chat_template_marks_exactly_the_assistant_tokens():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TEST_MODEL))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am Glimmer."}, {"role": "user", "content": "And 2 + 3?"},
                {"role": "assistant", "content": "5"}]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Glimmer.<|im_end|>\n<|im_start|>user\nAnd 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n")
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "I am Glimmer.<|im_end|>5<|im_end|>"


def test_shipped_assets_are_reproducible_from_the_build_script(tmp_path, monkeypatch):
    tools = _build_assets_module()
    assert tools.train_tokenizer().to_str() == (ASSETS / "tokenizer.json").read_text()
    shipped = tools.DATA_DIR
    monkeypatch.setattr(tools, "DATA_DIR", tmp_path)
    monkeypatch.setattr(tools, "ASSETS", tmp_path / "assets")
    tools.main()
    for rel in ("self_cognition/train.jsonl", "arithmetic/train.jsonl", "arithmetic/test.jsonl"):
        assert (tmp_path / rel).read_bytes() == (shipped / rel).read_bytes(), rel


def test_unknown_embedded_id_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown embedded model 'twinkle://qwen3-huge'; known: "
                                         r"twinkle://qwen3-tiny, twinkle://qwen3-demo"):
        resolve_model_path("twinkle://qwen3-huge")


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub id"):
        resolve_model_path(str(tmp_path / "nope"))


def test_local_folder_resolves_to_itself(tmp_path):
    assert resolve_model_path(tmp_path) == str(tmp_path)


def test_hub_id_without_network_fails_fast_with_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to fall back on
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "5")
    with pytest.raises(OfflineError, match="hf://Qwen/Qwen3-0.6B: the Hugging Face hub is unreachable"):
        resolve_model_path("hf://Qwen/Qwen3-0.6B")


@pytest.mark.skipif(importlib.util.find_spec("modelscope") is not None, reason="modelscope is installed")
def test_modelscope_id_names_the_extra_when_missing():
    with pytest.raises(ImportError, match=r"pip install 'twinkle-data\[modelscope\]'"):
        resolve_model_path("ms://Qwen/Qwen3-0.6B")


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    from twinkle.hub import cache_root

    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    monkeypatch.delenv("TWINKLE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "twinkle"
    assert os.fspath(cache_root()).endswith("twinkle")
