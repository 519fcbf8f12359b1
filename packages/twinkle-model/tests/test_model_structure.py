"""The structure description on tiny random models of every family users train (built offline
from transformers' config classes), and the tp planner's refusals that read it."""

import pytest
import torch
from peft import LoraConfig

from twinkle.model.families import FAMILIES, tiny_model
from twinkle.model.multi_lora.spec import AdapterSpec
from twinkle.model.structure import describe
from twinkle.model.tensor_parallel import check_divisible

ATTENTION = {
    "phi3": ["o_proj", "qkv_proj"],
    "deepseek_v3": ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"],
}
MLP = {"phi3": ["down_proj", "gate_up_proj"], "qwen3_moe": [], "gpt_oss": []}
EXPERT_LAYERS = {"qwen3_moe": 2, "gpt_oss": 2, "deepseek_v3": 1}  # deepseek's layer 0 is dense
# what tp=2 refuses at construction, by the first module it cannot shard
TP_REFUSED = {
    "phi3": "model.layers.0.self_attn.qkv_proj",
    "deepseek_v3": "model.layers.0.self_attn.q_a_proj",
    "qwen3_moe": "model.layers.0.mlp.experts.gate_up_proj",
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",
    "olmo2": "model.layers.0.self_attn.q_norm",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_model(request.param)


def test_roles_of_every_family(family):
    name, model = family
    s = describe(model)
    assert s.model_type == name and s.unplaced == []
    assert s.linear_targets("attention") == ATTENTION.get(name, ["k_proj", "o_proj", "q_proj", "v_proj"])
    assert s.linear_targets("mlp") == MLP.get(name, ["down_proj", "gate_proj", "up_proj"])
    assert s.linear_targets("unembedding") == ["lm_head"]
    experts = s.of("experts")
    assert len(experts) == 2 * EXPERT_LAYERS.get(name, 0)  # gate_up_proj and down_proj per MoE layer
    assert {p.param for p in experts} <= {"gate_up_proj", "down_proj"} and all(p.experts == 4 for p in experts)
    assert len(s.of("router")) == EXPERT_LAYERS.get(name, 0)
    assert len(s.head_params) == (2 if name == "gpt_oss" else 0)  # GPT-OSS attention sinks, per layer
    # every weight of the model is either placed in a role or is a norm / embedding / bias
    placed = {p.name for p in s.parts} | {p.module for p in s.parts}
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        if p.dim() >= 2 and "embed_tokens" not in pname:
            assert owner in placed or pname in placed, pname


def test_unknown_architecture_falls_back_to_linear_discovery():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    s = describe(model)
    assert s.parts == [] and s.unplaced == ["0", "2"]
    with pytest.raises(ValueError, match="unknown role"):
        s.of("attn")


def test_lora_selection_reads_fused_and_mla_projections(family):
    _name, model = family
    s = describe(model)
    spec = AdapterSpec.from_lora_config(LoraConfig(r=2, target_modules=s.linear_targets("attention", "mlp")))
    chosen = set(spec.select(model))
    assert chosen == {p.module for p in s.of("attention", "mlp")}
    assert not chosen & {p.module for p in s.of("router", "unembedding")}


# string target_modules peft users write (model cards, LLaMA-Factory / axolotl configs)
PEFT_PATTERNS = [
    r".*\.(q_proj|v_proj)",
    r".*(q_proj|k_proj|v_proj|o_proj)",
    r"model\.layers\.\d+\.mlp\..*",
    r"(?:.*\.)?(gate|up)_proj",
    r".*[qkv]_proj",
    r"model.layers.0.self_attn.q_proj",
    r"model\.layers\.[01]\.self_attn\.(q|k|v|o)_proj",
    r"(.*\.)?(o_proj|down_proj)$",
    r"^model\.layers\.\d{1,2}\.(self_attn|mlp)\.\w+$",
    r".*\.experts\.\d+\.(gate|up|down)_proj",
    r".*(attn|attention).*(query|key|value|[qkv]_(a_|b_)?proj)",
    r".*",
]


def test_peft_target_patterns_select_what_peft_selects(family):
    """A string target_modules selects, on the engine's linear-time matcher (twinkle.model.patterns),
    exactly the modules peft's own check selects, among every module of the family."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from twinkle.model.patterns import compile_pattern

    _name, model = family
    names = [n for n, _ in model.named_modules()]
    selecting = 0
    for pattern in PEFT_PATTERNS:
        peft = [n for n in names if check_target_module_exists(LoraConfig(target_modules=pattern), n)]
        assert [n for n in names if compile_pattern(pattern).fullmatch(n)] == peft, pattern
        selecting += bool(peft)
    assert selecting >= 7, selecting  # most patterns select something in every family: the equality is not vacuous


def test_tp_refuses_by_name_at_construction(family):
    name, model = family
    if name not in TP_REFUSED:
        check_divisible(model.config, 2, model)  # planned: column/row projections and per-head norms
        return
    with pytest.raises(ValueError, match=rf"cannot shard {TP_REFUSED[name]} \({name}\).*tp_size=1"):
        check_divisible(model.config, 2, model)


def test_all_linear_has_no_holes_in_either_engine(family):
    """'all-linear' is every attention and MLP Linear (DeepSeek's dense and shared-expert MLPs, its MLA
    projections, Phi-3's fused ones), never the router or the head, in peft's engine and ours."""
    from twinkle.model import TransformersModel
    from twinkle.model.families import tiny_config

    name, model = family
    s = describe(model)
    want = {p.module for p in s.of("attention", "mlp")}
    config = LoraConfig(r=2, target_modules="all-linear")
    assert set(AdapterSpec.from_lora_config(config).select(model)) == want
    tm = TransformersModel(config=tiny_config(name))
    if name == "deepseek_v3":
        # peft's v5 MoE conversion turns every *.gate_proj/up_proj/down_proj target into the fused
        # experts' target_parameters, so the dense layer-0 MLP and the shared experts would lose
        # theirs: refused by name (MultiLoraModel covers them, above)
        with pytest.raises(
            ValueError, match=r"leave 6 targeted Linear layers .*model.layers.0.mlp.down_proj.*MultiLoraModel"
        ):
            tm.add_adapter_to_model("a", config)
        assert tm.adapter_names == []
        return
    tm.add_adapter_to_model("a", config)
    wrapped = {n for n, m in tm.hf_model.named_modules() if hasattr(m, "lora_A") and n not in _expert_modules(s)}
    assert wrapped == want


def _expert_modules(s):
    return {p.module for p in s.of("experts")}
