"""TransformersModel refuses, at construction and by name, every DeviceMesh dim it does not
implement: otherwise the extra ranks would silently repeat the work."""

from __future__ import annotations

import pytest
import torch

from twinkle.hub import TEST_MODEL
from twinkle.mesh import DeviceMesh
from twinkle.model import TransformersModel


@pytest.mark.parametrize(
    "sizes,what",
    [
        (dict(pp_size=2), "pipeline parallelism (pp_size=2"),
        (dict(dp_size=2, ep_size=2), "expert parallelism (ep_size=2"),
        (dict(dp_size=2, tp_size=2, pp_size=2), "pipeline parallelism (pp_size=2"),
    ],
    ids=["pp", "ep", "dp-tp-pp"],
)
def test_unimplemented_dims_point_to_megatron(sizes, what):
    with pytest.raises(ValueError, match="TransformersModel does not implement") as e:
        TransformersModel(model_id=TEST_MODEL, device_mesh=DeviceMesh.from_sizes(**sizes))
    assert f"TransformersModel does not implement {what}" in str(e.value)
    assert "would only repeat the work" in str(e.value) and "Use MegatronModel" in str(e.value)


def test_ddp_on_a_sharded_mesh_is_refused():
    with pytest.raises(
        ValueError,
        match=r"strategy='ddp' replicates the model, but DeviceMesh\(fsdp_size=2\) "
        r"has fsdp_size=2, which shards it: pass strategy='fsdp2'",
    ):
        TransformersModel(
            model_id=TEST_MODEL, device_mesh=DeviceMesh.from_sizes(dp_size=1, fsdp_size=2), strategy="ddp"
        )


@pytest.mark.parametrize(
    "sizes,strategy,expected",
    [
        (dict(dp_size=1, fsdp_size=2), None, "fsdp2"),
        (dict(dp_size=2, fsdp_size=2), None, "fsdp2"),
        (dict(dp_size=2), None, "ddp"),
        (dict(dp_size=2), "fsdp2", "fsdp2"),
        (dict(dp_size=1), None, "ddp"),
    ],
)
def test_the_mesh_chooses_the_strategy(sizes, strategy, expected):
    from twinkle.model.strategy import resolve_strategy

    assert resolve_strategy(strategy, DeviceMesh.from_sizes(**sizes)) == expected


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'; expected one of \('ddp', 'fsdp2'\)"):
        TransformersModel(model_id=TEST_MODEL, strategy="zero3")


def test_tp_must_divide_the_heads_and_mlp_width():
    # qwen3-tiny: 4 query heads, 2 key/value heads, MLP width 192
    with pytest.raises(ValueError, match=r"tp_size=4 must divide num_key_value_heads=2 of the model config"):
        TransformersModel(model_id=TEST_MODEL, device_mesh=DeviceMesh.from_sizes(tp_size=4))
    with pytest.raises(ValueError, match=r"tp_size=3 must divide num_attention_heads=4, num_key_value_heads=2"):
        TransformersModel(model_id=TEST_MODEL, device_mesh=DeviceMesh.from_sizes(tp_size=3))


def test_tp_plan_refuses_what_it_cannot_split(tiny_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.model.tensor_parallel import parallelize

    def tiny():
        return AutoModelForCausalLM.from_pretrained(tiny_path)

    dora = get_peft_model(tiny(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"tp_size > 1 does not support DoRA \(use_dora=True\)"):
        parallelize(dora, tp_mesh=None)  # refused while planning, before any rank is touched
    odd = tiny()
    odd.model.layers[0].mlp.down_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj is a Identity"):
        parallelize(odd, tp_mesh=None)
