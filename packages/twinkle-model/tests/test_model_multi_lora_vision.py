"""MultiLoraModel with image rows on twinkle://qwen2.5-vl-tiny: the fused pass of two tenants with
images equals each tenant alone, the pixels reach the model, and the vision tower keeps no adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub.embedded_vl import VL_TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.template import Template

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]  # gate/down_proj exist in the vision tower too


@pytest.fixture(scope="module")
def rows():
    template = Template(VL_TEST_MODEL)
    return [template.encode(r) for r in Dataset(DatasetMeta("twinkle://shapes", data_slice=range(5)))]


def _engine(*names):
    engine = MultiLoraModel(VL_TEST_MODEL)
    torch.manual_seed(0)  # every engine of a comparison holds the same adapters
    for i, name in enumerate(names):
        engine.add_adapter_to_model(name, LoraConfig(r=4 + 2 * i, lora_alpha=8, target_modules=TARGETS), seed=i)
        for p in engine.adapters[name].params:  # B starts at zero: make the adapters matter from step one
            torch.nn.init.normal_(p, std=0.05)
    return engine


def _grads(engine, name):
    return [p.grad.clone() for p in engine.adapters[name].params]


def test_adapters_stay_out_of_the_vision_tower():
    engine = _engine("a")
    names = engine.adapters["a"].module_names
    assert names and all("language_model" in n for n in names)
    with pytest.raises(ValueError, match="only vision-tower layers"):
        engine.add_adapter_to_model("v", LoraConfig(r=2, target_modules=r".*visual.*mlp\.gate_proj"))


def test_fused_image_rows_equal_each_tenant_alone(rows):
    a_rows, b_rows = rows[:2], rows[2:5]  # unequal row counts: the fused batch pads and orders them
    alone = {}
    for name, mine in (("a", a_rows), ("b", b_rows)):
        engine = _engine("a", "b")
        out = engine.forward_backward(mine, adapter_name=name)
        alone[name] = (out["loss"], _grads(engine, name))
    engine = _engine("a", "b")
    fused = engine.forward_backward_fused({"a": a_rows, "b": b_rows})
    for name in ("a", "b"):
        loss, grads = alone[name]
        assert fused[name]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        for g_fused, g_alone in zip(_grads(engine, name), grads):
            torch.testing.assert_close(g_fused, g_alone, rtol=1e-5, atol=1e-6)


def test_the_pixels_reach_the_model(rows):
    engine = _engine("a")
    seen = engine.forward_only(rows[:2], adapter_name="a")["loss"]
    blank = [{**r, "pixel_values": [np.zeros_like(p) for p in r["pixel_values"]]} for r in rows[:2]]
    assert engine.forward_only(blank, adapter_name="a")["loss"] != pytest.approx(seen, rel=1e-4)


def _vision_engine():
    engine = MultiLoraModel(VL_TEST_MODEL)
    torch.manual_seed(0)
    engine.add_adapter_to_model("p", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), train_vision=("projector",))
    engine.add_adapter_to_model("t", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), train_vision=("tower",))
    engine.add_adapter_to_model("n", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    return engine


def test_train_vision_per_tenant_moves_only_its_own_copies(rows, tmp_path):
    """Tenant p trains its projector, t its tower, n neither: after fused steps each tenant's vision
    copies moved, the base (every weight) is bit-identical, a fused pass equals each tenant alone,
    and a saved adapter with its vision copies loads back to the same loss."""
    engine = _vision_engine()
    base = {n: p.detach().clone() for n, p in engine.base.named_parameters() if "lora_" not in n}
    names = {t: sorted({n.rsplit(".", 1)[0] for n in engine._vision_params[t]}) for t in ("p", "t", "n")}
    assert names["n"] == [] and all(".merger" in n for n in names["p"])
    assert names["t"] and not any("merger" in n for n in names["t"])
    before = {t: [p.detach().clone() for p in engine._vision_params[t].values()] for t in ("p", "t")}
    for t in ("p", "t", "n"):
        engine.set_optimizer("AdamW", adapter_name=t, lr=1e-2)
    batches = {"p": rows[:2], "t": rows[2:4], "n": rows[4:5]}
    for _ in range(2):
        engine.forward_backward_fused(batches)
        for t in batches:
            engine.clip_grad_and_step(adapter_name=t)
    for t in ("p", "t"):
        for old, new in zip(before[t], engine._vision_params[t].values()):
            assert not torch.equal(old, new)
    now = {n: p for n, p in engine.base.named_parameters() if "lora_" not in n}
    assert now.keys() == base.keys() and all(torch.equal(now[n], w) for n, w in base.items())

    fused = engine.forward_fused(batches)
    for t, mine in batches.items():
        assert fused[t]["loss"] == pytest.approx(engine.forward_only(mine, adapter_name=t)["loss"], rel=1e-5)
    engine.save(tmp_path / "p", adapter_name="p")
    again = MultiLoraModel(VL_TEST_MODEL)
    again.load(tmp_path / "p", "p")
    assert again._vision_train["p"] == ("projector",)
    assert again.forward_only(rows[:2], adapter_name="p")["loss"] == pytest.approx(fused["p"]["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="trains vision modules \\(train_vision\\): parking and spilling"):
        engine.park_adapter("p")
