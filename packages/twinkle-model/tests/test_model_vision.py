"""TransformersModel with image rows on twinkle://qwen2.5-vl-tiny: loss and gradients against a
hand-written transformers + peft computation on the same batch; training moves the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import resolve_model_path
from twinkle.hub.embedded_vl import VL_TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.template import Template

LANGUAGE_ONLY = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def lora():
    # init_lora_weights=False: B is random too, so the adapter changes the loss from the first step
    return LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE_ONLY, init_lora_weights=False)


@pytest.fixture(scope="module")
def rows():
    template = Template(VL_TEST_MODEL)
    return [template.encode(r) for r in Dataset(DatasetMeta("twinkle://shapes", data_slice=range(4)))]


def _hand_loss(rows):
    """The same batch through transformers' own model and peft, collated and scored by hand."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(resolve_model_path(VL_TEST_MODEL), dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(model, lora(), adapter_name="default")
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full((len(rows), T), -100)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    image_id = model.config.image_token_id
    out = model(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=torch.cat([torch.tensor(np.asarray(r["pixel_values"])) for r in rows]),
        image_grid_thw=torch.tensor([g for r in rows for g in r["image_grid_thw"]]),
        mm_token_type_ids=(ids == image_id).int(),
    )
    logits, targets = out.logits[:, :-1], labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
    )
    loss.backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def test_image_batch_loss_and_grads_equal_hand_written_transformers_peft(rows):
    m = TransformersModel(model_id=VL_TEST_MODEL)
    torch.manual_seed(0)
    m.add_adapter_to_model("default", lora())
    m.set_optimizer("AdamW", lr=1e-3)
    ours = m.forward_backward(inputs=rows)["loss"]
    ours_grads = {n.replace(".default", ""): p.grad for n, p in m.states["default"].named_params()}
    expected, grads = _hand_loss(rows)
    assert ours == pytest.approx(expected, rel=1e-5)
    assert ours_grads.keys() == grads.keys() and len(grads) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    assert all("visual" not in n for n in grads)  # the vision tower and projector stay frozen
    for n, g in grads.items():
        scale = g.abs().max()
        assert (ours_grads[n] - g).abs().max() <= 1e-4 * scale + 1e-12, n


def test_the_image_changes_the_loss_and_training_lowers_it(rows):
    m = TransformersModel(model_id=VL_TEST_MODEL)
    m.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules=LANGUAGE_ONLY))
    m.set_optimizer("AdamW", lr=2e-2)
    other = [{**r, "pixel_values": [[-v for v in p] for p in r["pixel_values"]]} for r in rows]
    assert m.forward_only(inputs=rows)["loss"] != pytest.approx(m.forward_only(inputs=other)["loss"], rel=1e-6)
    losses = []
    for _ in range(8):
        losses.append(m.forward_backward(inputs=rows)["loss"])
        m.clip_grad_and_step()
    assert losses[-1] < losses[0] - 0.3


def test_a_text_only_model_refuses_pixel_values(rows):
    from twinkle.hub import TEST_MODEL

    m = TransformersModel(model_id=TEST_MODEL)
    bad = [
        {
            "input_ids": [1, 2, 3],
            "labels": [1, 2, 3],
            "pixel_values": rows[0]["pixel_values"],
            "image_grid_thw": [[1, 4, 4]],
        }
    ]
    with pytest.raises(ValueError, match="the batch holds images but the model \\(Qwen3Config\\) is text-only"):
        m.forward_only(inputs=bad)


def test_text_only_multi_lora_refuses_image_rows_by_name(rows):
    from twinkle.hub import TEST_MODEL
    from twinkle.model import MultiLoraModel

    m = MultiLoraModel(TEST_MODEL)
    m.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"the batch holds images but the model \(Qwen3Config\) is text-only"):
        m.forward_backward(inputs=rows[:1], adapter_name="a")


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("parts", [(), ("projector",), ("projector", "tower")])
def test_train_vision_moves_the_flagged_parts_and_nothing_else(rows, parts, tmp_path):
    """Steps with train_vision=parts: the flagged vision modules' adapter copies move, the base
    weights (vision and language) stay bit-identical (no optimizer holds them), and by default no
    vision parameter trains at all."""
    m = TransformersModel(model_id=VL_TEST_MODEL)
    base = _weights(m.hf_model)
    m.add_adapter_to_model("default", lora(), train_vision=parts)
    trained = dict(m.states["default"].named_params())
    vision_trained = sorted({n.split(".modules_to_save")[0] for n in trained if "visual" in n})
    expected = {(): [], ("projector",): ["model.visual.merger"]}.get(
        parts, ["model.visual.blocks.0", "model.visual.blocks.1", "model.visual.merger", "model.visual.patch_embed"]
    )
    assert [n.removeprefix("base_model.model.") for n in vision_trained] == expected
    before = {n: p.detach().clone() for n, p in trained.items()}
    m.set_optimizer("AdamW", lr=1e-2)
    for _ in range(2):
        m.forward_backward(inputs=rows)
        m.clip_grad_and_step()
    for n, p in trained.items():
        assert not torch.equal(p, before[n]), f"{n} did not move"
    now = {
        n.replace("base_model.model.", "").replace(".original_module", "").replace(".base_layer", ""): p
        for n, p in m.peft_model.named_parameters()
        if ".default." not in n
    }
    assert now.keys() == base.keys()
    for n, w in base.items():
        assert torch.equal(now[n], w), f"base weight {n} changed"
    if parts:  # the vision copies travel with the saved adapter (peft modules_to_save)
        m.save(tmp_path / "a")
        again = TransformersModel(model_id=VL_TEST_MODEL)
        again.load(tmp_path / "a")
        assert again.forward_only(inputs=rows)["loss"] == pytest.approx(m.forward_only(inputs=rows)["loss"], rel=1e-6)


def test_train_vision_refuses_unknown_parts_and_text_only_models():
    from twinkle.hub import TEST_MODEL

    with pytest.raises(ValueError, match=r"unknown part\(s\) \['encoder'\]; choose from \['projector', 'tower'\]"):
        TransformersModel(model_id=VL_TEST_MODEL).add_adapter_to_model("a", lora(), train_vision=("encoder",))
    with pytest.raises(ValueError, match=r"train_vision=\['projector'\]: the model \(Qwen3Config\) is text-only"):
        TransformersModel(model_id=TEST_MODEL).add_adapter_to_model("a", lora(), train_vision="projector")


def test_packed_image_rows_equal_padded_loss_and_grads(rows):
    """Packing (padding-free, one row) with images: the 3-D rope positions restart per sequence as
    the model's get_rope_index makes them alone, and loss and gradients equal the padded batch's."""
    from twinkle.model.vision import packed_rope_positions
    from twinkle.processor import InputProcessor

    results = {}
    for packing in (False, True):
        m = TransformersModel(model_id=VL_TEST_MODEL)
        torch.manual_seed(0)
        m.add_adapter_to_model("default", lora())
        m.set_processor("InputProcessor", packing=packing)
        loss = m.forward_backward(inputs=rows)["loss"]
        results[packing] = loss, {n: p.grad.clone() for n, p in m.states["default"].named_params()}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for n, g in results[False][1].items():
        assert (results[True][1][n] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-12, n

    packed = InputProcessor(packing=True)(rows)
    positions = packed_rope_positions(m.hf_model, packed)
    assert positions.shape == (4, 1, packed["input_ids"].shape[1])
    start, grids = 0, packed["image_grid_thw"]
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids = torch.tensor([r["input_ids"]])
        alone, _ = m.hf_model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == m.hf_model.config.image_token_id).int(), image_grid_thw=grids[i : i + 1]
        )
        assert torch.equal(positions[1:, 0, start : start + n], alone[:, 0]), i
        assert positions[0, 0, start : start + n].tolist() == list(range(n))
        start += n
