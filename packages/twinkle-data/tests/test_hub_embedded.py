"""The embedded default models: offline, deterministic, loaded like any checkpoint."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.hub import DEFAULT_MODEL, TEST_MODEL, OfflineError, embedded_path, resolve_model_path
from twinkle.hub.embedded import ASSETS, PINNED_WEIGHTS, weights_digest, write_folder

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "build_assets.py"


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
    assert (
        weights_digest(a / "model.safetensors")
        == weights_digest(b / "model.safetensors")
        == PINNED_WEIGHTS["qwen3-tiny"]
    )
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert not [p for p in a.parent.iterdir() if p.is_dir() and p.name.startswith(".")], "staging left behind"


def test_hand_written_files_equal_what_save_pretrained_writes_in_one_process(tmp_path):
    """The builder writes every file itself (save_pretrained skips weights off rank 0); in a plain
    process the two must agree byte for byte, so a folder is the same whoever built it."""
    from twinkle.hub.embedded import build_model, build_tokenizer

    (tmp_path / "ours").mkdir()
    write_folder("qwen3-tiny", tmp_path / "ours")
    tokenizer = build_tokenizer()
    build_model("qwen3-tiny", tokenizer).save_pretrained(tmp_path / "hf", safe_serialization=True)
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    ours, theirs = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


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
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Glimmer."},
        {"role": "user", "content": "And 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Glimmer.<|im_end|>\n<|im_start|>user\nAnd 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
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
    with pytest.raises(
        ValueError,
        match=r"unknown embedded model 'twinkle://qwen3-huge'; known: "
        r"twinkle://qwen3-tiny, twinkle://qwen3-demo",
    ):
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


def test_the_pinned_build_comes_out_the_same_on_the_scalar_kernels(tmp_path):
    """torch's normal_ differs in the last bits between its AVX2 and scalar paths (an ARM laptop takes the
    scalar one); the embedded weights are drawn without it, so a build forced onto the scalar kernels still
    matches the pin instead of being refused."""
    import subprocess
    import sys

    code = "from twinkle.hub import TEST_MODEL, embedded_path as e; print(e(TEST_MODEL))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "TWINKLE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert weights_digest(folder / "model.safetensors") == PINNED_WEIGHTS["qwen3-tiny"]


def test_portable_init_draws_every_random_tensor_at_the_configs_scale():
    from twinkle.hub.embedded import build_model, build_tokenizer

    model = build_model("qwen3-tiny", build_tokenizer())
    std = model.config.initializer_range
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            rows = (
                p
                if "embed_tokens" not in name
                else torch.cat([p[: model.config.pad_token_id], p[model.config.pad_token_id + 1 :]])
            )
            assert abs(rows.std().item() - std) < 0.1 * std, name
            assert rows.abs().max().item() <= std * 3**0.5, name  # uniform: bounded by sqrt(3) std
        else:
            assert torch.equal(p, torch.ones_like(p)), name  # the norms' ones are left as transformers sets them
    assert torch.equal(
        model.model.embed_tokens.weight[model.config.pad_token_id], torch.zeros(model.config.hidden_size)
    )
