"""Tinker's train_attn / train_mlp / train_unembed cover every parameter they name, on every family.

What a flag names is decided here independently of twinkle.model.structure: attention is every
matrix under a layer's `self_attn`, MLP every matrix under its `mlp` except the router (Tinker's
train_mlp says "the MLP layers (including MoE layers)"), unembedding the output head. Covered is
what the multi-LoRA engine actually wraps from the target_modules the server's mapping produces.
"""

import pytest
from peft import LoraConfig

from twinkle.model.families import FAMILIES, tiny_model
from twinkle.model.multi_lora.spec import AdapterSpec
from twinkle.serve.backend import LoraSpec, UserError

MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def _named(model, flag: str) -> dict[str, int]:
    """{parameter name: numel} of the matrices a flag names."""
    if flag == "unembed":
        return {"lm_head.weight": model.get_output_embeddings().weight.numel()}  # tied or not
    routers = {n for n, m in model.named_modules() if "Router" in type(m).__name__}
    part = ".self_attn." if flag == "attn" else ".mlp."
    return {
        n: p.numel()
        for n, p in model.named_parameters(remove_duplicate=False)
        # GPT-OSS's expert biases are [experts, out]: one vector per expert, not a matrix LoRA adapts
        if part in n and p.dim() >= 2 and not n.endswith("bias") and n.rsplit(".", 1)[0] not in routers
    }


def _coverage(model, flag: str) -> float:
    spec = LoraSpec(rank=2, train_attn=flag == "attn", train_mlp=flag == "mlp", train_unembed=flag == "unembed")
    config = LoraConfig(
        r=2, target_modules=spec.target_modules(model), target_parameters=spec.target_parameters(model) or None
    )
    adapter = AdapterSpec.from_lora_config(config)
    chosen = set(adapter.select(model)) | set(adapter.select_parameters(model))  # Linear layers, expert weights
    named = _named(model, flag)
    covered = sum(numel for n, numel in named.items() if n.rsplit(".", 1)[0] in chosen or n in chosen)
    return covered / sum(named.values())


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_model(request.param)


@pytest.mark.parametrize("flag", ["attn", "unembed"])
def test_attention_and_unembedding_flags_cover_everything_they_name(family, flag):
    assert _coverage(family[1], flag) == 1.0


def test_mlp_flag_covers_every_mlp_matrix(family):
    """Experts included: their 3-D weights get expert LoRA (twinkle.model.multi_lora.experts)."""
    assert _coverage(family[1], "mlp") == 1.0


def test_mlp_flag_names_the_expert_weights_of_moe_families(family):
    name, model = family
    experts = LoraSpec(train_attn=False, train_unembed=False).target_parameters(model)
    assert (len(experts) > 0) == (name in MOE)
    assert all(e.endswith(("experts.gate_up_proj", "experts.down_proj")) for e in experts)


def test_no_flag_is_a_user_error():
    with pytest.raises(UserError, match="trains nothing"):
        LoraSpec(train_attn=False, train_mlp=False, train_unembed=False).roles()
