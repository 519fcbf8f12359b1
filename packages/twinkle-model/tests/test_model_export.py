"""Merged export: base + LoRA folded into one transformers folder that AutoModelForCausalLM loads, with
logits equal to peft's base+adapter (fp32) whether the LoRA came as a local PEFT folder or a server
checkpoint folder; a LoRA on the tied lm_head leaves the input embeddings alone."""

from __future__ import annotations

import json

import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model.checkpoint import load_adapter, save_adapter
from twinkle.model.export import checkpoint_base, export_merged

TOKENS = torch.tensor([[5, 17, 99, 3, 250, 41, 8, 600, 12, 77]])


@pytest.fixture(scope="module")
def base_path() -> str:
    return resolve_model_path(TEST_MODEL)


@pytest.fixture(scope="module")
def peft_folder(base_path, tmp_path_factory):
    """A LoRA on attention, MLP and the (tied) lm_head with non-zero B, saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("peft")
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def peft_logits(base_path, folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder)).eval()(input_ids=TOKENS).logits


@torch.no_grad()
def exported_logits(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, model(input_ids=TOKENS).logits


def test_a_local_peft_folder_merges_to_equal_logits(base_path, peft_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_merged(peft_folder, tmp_path / "merged")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / "adapter_config.json").exists()
    model, logits = exported_logits(out)
    expected = peft_logits(base_path, peft_folder)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with torch.no_grad():
        assert (base(input_ids=TOKENS).logits - expected).abs().max() > 0.1  # the adapter matters
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()
    # the lm_head LoRA went into an untied head; the input embeddings are the base's
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    assert AutoTokenizer.from_pretrained(str(out)).encode("a cat") == AutoTokenizer.from_pretrained(base_path).encode(
        "a cat"
    )


def test_a_server_checkpoint_folder_names_its_base_and_exports_in_bf16(base_path, peft_folder, tmp_path):
    config, tensors = load_adapter(peft_folder)
    ckpt = tmp_path / "tenants" / "ann" / "run_train_0" / "sampler_weights" / "final"
    save_adapter(ckpt, config, tensors, base_model="/not/where/the/base/is")
    (ckpt / "twinkle_checkpoint.json").write_text(json.dumps({"base_model": TEST_MODEL, "model_id": "run:train:0"}))
    assert checkpoint_base(ckpt) == TEST_MODEL  # the server's record wins over peft's field
    out = export_merged(ckpt, tmp_path / "merged-bf16", dtype="bfloat16")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert next(model.parameters()).dtype == torch.bfloat16
    fp32 = export_merged(ckpt, tmp_path / "merged-fp32")
    _, logits = exported_logits(fp32)
    assert torch.allclose(logits, peft_logits(base_path, peft_folder), atol=1e-4, rtol=1e-4)


def test_bad_exports_are_clear_errors(peft_folder, tmp_path):
    with pytest.raises(ValueError, match="is not a LoRA checkpoint folder"):
        export_merged(tmp_path, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_merged(peft_folder, tmp_path / "full")
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_merged(peft_folder, tmp_path / "out", dtype="int8")
    bare = tmp_path / "bare"
    config, tensors = load_adapter(peft_folder)
    config.base_model_name_or_path = None
    save_adapter(bare, config, tensors)
    with pytest.raises(ValueError, match="pass the base model explicitly"):
        export_merged(bare, tmp_path / "out")
