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
