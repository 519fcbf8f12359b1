"""MegatronModel on a GPU: the converted model's logits equal the HF model's, training lowers the
loss, and the save is an HF folder. Run on a CUDA machine with the extra installed:
`pytest -m gpu packages/twinkle-model/tests/test_model_megatron_gpu.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: megatron-core's schedules hard-code it"),
]


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("megatron.core", reason="needs the extra: pip install 'twinkle-model[megatron]'")
    from twinkle.hub import TEST_MODEL
    from twinkle.model import MegatronModel

    return MegatronModel(model_id=TEST_MODEL, seed=0)


def _rows():
    g = torch.Generator().manual_seed(7)
    return [
        {"input_ids": (ids := torch.randint(3, 850, (n,), generator=g).tolist()), "labels": [-100] * 2 + ids[2:]}
        for n in (9, 12, 7, 12)
    ]


def _logits(model, rows):
    batch, _ = model._batch(rows)
    T = batch["input_ids"].shape[1]
    with torch.no_grad():
        return model.gpt(
            batch["input_ids"],
            torch.arange(T, device="cuda")[None].expand_as(batch["input_ids"]),
            model._attention_mask(batch),
        ).float(), batch["attention_mask"].bool()


def _hf_logits(path, rows):
    from transformers import AutoModelForCausalLM

    from twinkle.model.inputs import collate

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    batch, _ = collate(rows, None)
    with torch.no_grad():
        return hf(input_ids=batch["input_ids"].cuda(), attention_mask=batch["attention_mask"].cuda()).logits.float()


def test_converted_logits_equal_the_hf_model(model):
    ours, valid_B_T = _logits(model, _rows())
    theirs = _hf_logits(model.model_path, _rows())
    assert (ours - theirs)[valid_B_T].abs().max().item() <= 1e-3


def test_training_lowers_the_loss_and_saves_an_hf_folder(model, tmp_path):
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(5):
        losses.append(model.forward_backward(inputs=_rows())["loss"])
        assert model.clip_grad_and_step()["stepped"]
    assert losses[-1] < losses[0] - 0.1, losses
    assert model.calculate_metric()["step"] == 5.0
    model.save(tmp_path / "hf")
    ours, valid_B_T = _logits(model, _rows())
    theirs = _hf_logits(tmp_path / "hf", _rows())
    assert (ours - theirs)[valid_B_T].abs().max().item() <= 1e-3
