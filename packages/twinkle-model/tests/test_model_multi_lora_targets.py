"""Which layers an adapter targets must not depend on what other tenants' adapters wrapped before it."""

from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel


def test_all_linear_skips_the_head_even_after_another_adapter_wrapped_it():
    model = MultiLoraModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("first", LoraConfig(r=2, target_modules="all-linear"))
    model.add_adapter_to_model("head", LoraConfig(r=2, target_modules=["lm_head"]))  # Tinker's train_unembed
    model.add_adapter_to_model("later", LoraConfig(r=2, target_modules="all-linear"))
    first, later = model.adapters["first"].module_names, model.adapters["later"].module_names
    assert later == first and len(first) == 14
    assert not [n for n in later if n.endswith("lm_head")]
    assert model.adapters["head"].module_names == ["lm_head"]
