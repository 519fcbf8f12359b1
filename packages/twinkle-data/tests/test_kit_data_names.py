"""twinkle-kit's data names and keywords on our data layer: Qwen3_5Template (text and vision), the
range(N) data_slice that repeats the data, map(init_args=...), encode(load_from_cache_file=...),
SelfCognitionProcessor(model_name=, model_author=)."""

from __future__ import annotations

import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.dataset.errors import DataError
from twinkle.hub import TEST_MODEL
from twinkle.hub.embedded_vl import VL_TEST_MODEL
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template import TEMPLATES, Qwen3_5Template, Template


def test_a_range_past_the_end_repeats_the_data():
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(450)))
    assert len(ds) == 450
    assert ds[0] == ds[200] == ds[400] and ds[199] == ds[399] and ds[1] != ds[0]
    with pytest.raises(DataError, match="asks for row 205 but the dataset has 200 rows"):
        Dataset(DatasetMeta("twinkle://self-cognition", data_slice=[0, 205]))


def test_map_init_args_and_the_kit_names_of_self_cognition():
    by_init_args = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(3))).map(
        "SelfCognitionProcessor", init_args={"model_name": "Glint", "model_author": "Lab"}, load_from_cache_file=False
    )
    by_position = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(3))).map(
        SelfCognitionProcessor("Glint", "Lab"), batched=True
    )
    assert list(by_init_args) == list(by_position)
    assert "Glint" in by_init_args[0]["messages"][1]["content"]
    with pytest.raises(TypeError, match="both init_args and keyword arguments"):
        Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(1))).map(
            "SelfCognitionProcessor", init_args={"name": "a"}, author="b"
        )
    with pytest.raises(TypeError, match="got both name and model_name"):
        SelfCognitionProcessor("a", "b", model_name="c")


def test_encode_load_from_cache_file_is_the_cache_switch():
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(4))).map(SelfCognitionProcessor("G", "L"))
    ds.set_template("Qwen3_5Template", model_id=TEST_MODEL, max_length=64)
    ds.encode(batched=True, load_from_cache_file=False)
    reference = Template(TEST_MODEL, max_length=64).encode(ds[0])
    assert ds[0]["input_ids"] == reference["input_ids"] and ds[0]["labels"] == reference["labels"]


def test_qwen3_5_template_is_registered_and_text_models_have_no_vision():
    assert TEMPLATES.get("Qwen3_5Template") is Qwen3_5Template
    text = Qwen3_5Template(TEST_MODEL)
    assert (text.is_vision, text.patch_size, text.merge_size) == (False, None, None)
    assert text.vllm_input_ids([1, 2, 2, 3]) == [1, 2, 2, 3]


def test_qwen3_5_template_expands_images_and_folds_them_for_vllm():
    template = Qwen3_5Template(VL_TEST_MODEL)
    row = next(iter(Dataset(DatasetMeta("twinkle://shapes", data_slice=range(1)))))
    encoded = template.encode(row)
    pad = template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = encoded["image_grid_thw"][0]
    per_image = int(grid[0] * grid[1] * grid[2]) // template.merge_size**2
    assert template.is_vision and template.patch_size == 14 and template.merge_size == 2
    assert encoded["input_ids"].count(pad) == per_image > 1
    folded = template.vllm_input_ids(encoded["input_ids"])
    assert folded.count(pad) == 1 and len(folded) == len(encoded["input_ids"]) - per_image + 1
