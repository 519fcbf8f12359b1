"""InputProcessor: padding either side, padding-free packing, and equal per-token losses on the
embedded model whichever way a batch is laid out."""

import pytest
import torch

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.processor import InputProcessor

ROWS = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]


def test_right_and_left_padding():
    right = InputProcessor(pad_token_id=0)(ROWS)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert right["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert right["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    left = InputProcessor(padding_side="left", pad_to_multiple_of=4)(ROWS)
    assert left["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 8, 9]]
    assert left["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 1, 1]]
    assert left["position_ids"].tolist() == [[0, 0, 1, 2], [0, 0, 0, 1]]
    assert {k: v.dtype for k, v in left.items()} == dict.fromkeys(left, torch.long)


def test_packing_restarts_positions():
    packed = InputProcessor(packing=True)([*ROWS, {"input_ids": [4]}])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9, -100]]
    assert "attention_mask" not in packed  # a mask would merge the sequences; positions separate them


def test_bad_rows_are_named():
    with pytest.raises(ValueError, match="batch row 1 has no 'input_ids'"):
        InputProcessor()([ROWS[0], {"messages": []}])
    with pytest.raises(ValueError, match="batch row 0: 3 input_ids but 2 labels"):
        InputProcessor()([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


def per_token_losses(logits_B_T_V, labels_B_T):
    """Loss of every trained token, in order, as HF computes it (labels shifted by one)."""
    logits, labels = logits_B_T_V[:, :-1], labels_B_T[:, 1:]
    keep = labels != -100
    return torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none")


def test_padded_and_packed_losses_equal_on_embedded_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=[0, 5, 17, 42, 99]))
    ds.map(SelfCognitionProcessor("Glimmer", "Lantern Labs")).set_template("Template", model_id=TEST_MODEL).encode()
    rows = ds.data.to_list()
    assert len({len(r["input_ids"]) for r in rows}) > 1  # lengths differ, so padding really happens
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32).eval()
    pad_id = ds.template.tokenizer.pad_token_id
    results = {}
    with torch.no_grad():
        for side in ("right", "left"):
            batch = InputProcessor(padding_side=side, pad_token_id=pad_id)(rows)
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                use_cache=False,
            ).logits
            results[side] = per_token_losses(logits, batch["labels"])
        packed = InputProcessor(packing=True)(rows)
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        results["packed"] = per_token_losses(logits, packed["labels"])
    assert results["right"].numel() == sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)
    torch.testing.assert_close(results["packed"], results["right"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["left"], results["right"], rtol=1e-5, atol=1e-5)
    # without the restart the sequences would see each other and the losses would differ
    wrong = packed["position_ids"].new_tensor(range(packed["input_ids"].shape[1]))[None]
    with torch.no_grad():
        merged = model(input_ids=packed["input_ids"], position_ids=wrong, use_cache=False).logits
    assert not torch.allclose(per_token_losses(merged, packed["labels"]), results["right"], atol=1e-4)
