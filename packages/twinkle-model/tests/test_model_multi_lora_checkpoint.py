"""Each adapter saves as an ordinary peft LoRA folder of its own rank, which peft loads with
identical logits, and which the engine loads back as a new tenant."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model.multi_lora import MultiLoraModel

torch.set_num_threads(2)

CONFIGS = {
    "small": LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"),
    "large": LoraConfig(r=24, lora_alpha=12, target_modules=["q_proj", "o_proj", "up_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = MultiLoraModel(TEST_MODEL)
    g = torch.Generator().manual_seed(0)
    batches = {
        n: [{"input_ids": torch.randint(3, 800, (10,), generator=g).tolist()} for _ in range(2)] for n in CONFIGS
    }
    for name, config in CONFIGS.items():
        model.add_adapter_to_model(name, config)
        model.set_optimizer("AdamW", adapter_name=name, lr=5e-2)
    for _ in range(2):  # B leaves zero: the saved adapters change the logits
        model.forward_backward_fused(batches)
        for name in CONFIGS:
            model.clip_grad_and_step(adapter_name=name)
    root = tmp_path_factory.mktemp("ckpt")
    return model, {name: model.save(str(root / name), adapter_name=name) for name in CONFIGS}


PROBE = [{"input_ids": list(range(5, 19))}, {"input_ids": list(range(40, 49))}]


def test_saved_folder_is_plain_peft_of_its_own_rank(trained):
    model, paths = trained
    for name, config in CONFIGS.items():
        saved = json.loads(Path(paths[name], "adapter_config.json").read_text())
        assert saved["r"] == config.r and saved["lora_alpha"] == config.lora_alpha
        assert saved["peft_type"] == "LORA" and saved["base_model_name_or_path"] == resolve_model_path(TEST_MODEL)
        tensors = load_file(f"{paths[name]}/adapter_model.safetensors")
        key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
        assert tensors[key].shape == (config.r, 96)
        assert len(tensors) == 2 * len(model.adapters[name].module_names)


def test_peft_loads_each_adapter_with_identical_logits(trained):
    model, paths = trained
    for name in CONFIGS:
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL))
        peft_model = PeftModel.from_pretrained(base, paths[name]).eval()
        ids = torch.tensor([PROBE[0]["input_ids"]])
        with torch.no_grad():
            expected = peft_model(input_ids=ids).logits
        ours = model.logits(PROBE[:1], adapter_name=name)
        assert torch.allclose(ours, expected, atol=1e-5), (name, (ours - expected).abs().max())
        base_logits = model.logits(PROBE[:1], base_only=True)
        assert (base_logits - expected).abs().max() > 1e-3  # the adapter really is in those logits


def test_engine_loads_a_saved_adapter_as_a_new_tenant(trained):
    model, paths = trained
    model.load(paths["large"], "large_copy")
    try:
        assert model.adapters["large_copy"].spec.rank == 24
        assert torch.equal(model.logits(PROBE, adapter_name="large_copy"), model.logits(PROBE, adapter_name="large"))
    finally:
        model.remove_adapter("large_copy")
    with pytest.raises(FileNotFoundError, match="not a LoRA checkpoint"):
        model.load(str(paths["large"]) + "-missing", "x")
    assert "x" not in model.adapter_names
