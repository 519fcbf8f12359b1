"""model.push_to_hub against a local STAND-IN of the Hugging Face Hub's upload API (the one in
packages/twinkle-client/tests/hub_standin.py; no hub is reachable from these machines): huggingface_hub's
own create_repo/upload_folder run unchanged, and the stand-in must receive exactly what `save` writes."""

import importlib.util
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel

_STANDIN = Path(__file__).resolve().parents[2] / "twinkle-client" / "tests" / "hub_standin.py"
_spec = importlib.util.spec_from_file_location("hub_standin", _STANDIN)
hub_standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hub_standin)


@pytest.fixture
def no_xet(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks LFS


def test_push_to_hub_uploads_what_save_writes(rows, tmp_path, no_xet):
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step()
    local = Path(model.save(tmp_path / "local"))
    expected = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in expected and "adapter_config.json" in expected

    with hub_standin.HubStandIn() as hub:
        url = model.push_to_hub("hf://org/tiny-lora", endpoint=hub.endpoint, token=hub_standin.TOKEN)
        assert url.startswith(f"{hub.endpoint}/org/tiny-lora/commit/")
        assert hub.repos["org/tiny-lora"] == expected
        assert hub.lfs_paths == ["adapter_model.safetensors"]


def test_push_to_hub_refuses_a_malformed_repo_id():
    model = TransformersModel(model_id=TEST_MODEL)
    for bad in ("name-only", "gh://org/name", "hf://org/", "a/b/c"):
        with pytest.raises(ValueError, match="push_to_hub needs ORG/NAME, hf://ORG/NAME or ms://ORG/NAME"):
            model.push_to_hub(bad)
