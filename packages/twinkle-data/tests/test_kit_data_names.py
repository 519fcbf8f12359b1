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


def test_dataloader_get_state_and_resume_continue_at_the_next_unseen_sample():
    from twinkle.dataloader import DataLoader

    def build():  # twinkle-kit passes a factory
        return Dataset(DatasetMeta("twinkle://arithmetic", split="test", data_slice=range(10)))

    first = DataLoader(dataset=build, batch_size=4, min_batch_size=4)
    batches = iter(first)
    seen = [next(batches), next(batches)]
    assert first.get_state()["consumed_train_samples"] == 8
    resumed = DataLoader(dataset=build, batch_size=4, min_batch_size=4)
    resumed.resume_from_checkpoint(first.get_state()["consumed_train_samples"])
    rest = list(resumed)  # 2 rows left: below min_batch_size, so the epoch ends
    assert rest == [] and resumed.get_state()["consumed_train_samples"] == 10
    again = DataLoader(dataset=build, batch_size=4)
    again.resume_from_checkpoint(4)
    assert next(iter(again)) == seen[1]
    with pytest.raises(ValueError, match="remote_group 'model' is not a DeviceGroup"):
        DataLoader(dataset=build, batch_size=4, remote_group="model")


def _encoded(n=40):
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(n))).map(SelfCognitionProcessor("G", "L"))
    return ds.set_template("Template", model_id=TEST_MODEL, max_length=96).encode(cache=False)


def test_packing_dataset_bins_sequences_and_collates_them_padding_free():
    from twinkle.dataset import PackingDataset
    from twinkle.processor import InputProcessor

    rows = list(_encoded())
    packed = PackingDataset(DatasetMeta("twinkle://self-cognition", data_slice=range(40))).map(
        SelfCognitionProcessor("G", "L")
    )
    packed.set_template("Qwen3_5Template", model_id=TEST_MODEL, max_length=96).encode(cache=False).pack_dataset()
    bins = list(packed)
    assert len(bins) < len(rows) and all(len(b["input_ids"]) <= 96 for b in bins)
    assert sorted(n for b in bins for n in b["lengths"]) == sorted(len(r["input_ids"]) for r in rows)
    assert sum(len(b["lengths"]) for b in bins) == 40 and all(b["position_ids"][0] == 0 for b in bins)
    by_bins = InputProcessor()(bins[:2])
    one_by_one = InputProcessor(padding_free=True)(
        [
            {"input_ids": b["input_ids"][s : s + n], "labels": b["labels"][s : s + n]}
            for b in bins[:2]
            for s, n in _spans(b)
        ]
    )
    for key in ("input_ids", "labels", "position_ids"):
        assert by_bins[key].tolist() == one_by_one[key].tolist()
    assert "attention_mask" not in by_bins


def _spans(row):
    start = 0
    for n in row["lengths"]:
        yield start, n
        start += n


def test_iterable_packing_and_lazy_datasets_give_the_same_rows_as_eager_ones():
    from twinkle.dataset import IterablePackingDataset, LazyDataset

    eager = _encoded(12)
    lazy = LazyDataset(DatasetMeta("twinkle://self-cognition", data_slice=range(12))).map(
        "SelfCognitionProcessor", init_args={"name": "G", "author": "L"}
    )
    lazy.set_template("Template", model_id=TEST_MODEL, max_length=96).encode()
    assert lazy[5]["input_ids"] == eager[5]["input_ids"] and len(lazy) == 12
    stream = IterablePackingDataset(DatasetMeta("twinkle://self-cognition", data_slice=range(12)))
    stream.map(SelfCognitionProcessor("G", "L")).set_template("Template", model_id=TEST_MODEL, max_length=96)
    bins = list(stream.encode().pack_dataset())
    flat = [t for b in bins for t in b["input_ids"]]
    assert flat == [t for r in eager for t in r["input_ids"]]  # arrival order, nothing split or lost
    with pytest.raises(DataError, match="filters raw rows, before any map"):
        lazy.filter(lambda row: True)


def test_preference_pairs_in_twinkle_kit_form_encode_side_by_side():
    from twinkle.preprocessor import EmojiDPOProcessor

    rows = [{"prompt": "Hi?", "answer_zh": "你好", "answer_en": "Hello"}]
    ds = Dataset(DatasetMeta("pairs", data=rows)).map(EmojiDPOProcessor, init_args={"system": "Be kind."})
    ds.set_template("Qwen3_5Template", model_id=TEST_MODEL).encode(cache=False)
    row = ds[0]
    template = Template(TEST_MODEL)
    chosen = template.encode(
        {
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "你好"},
            ]
        }
    )
    assert row["positive"]["input_ids"] == chosen["input_ids"] and row["positive"]["labels"] == chosen["labels"]
    assert row["negative"]["input_ids"] != row["positive"]["input_ids"]
    with pytest.raises(DataError, match="no column 'answer_en'"):
        Dataset(DatasetMeta("bad", data=[{"prompt": "a", "answer_zh": "b"}])).map(EmojiDPOProcessor())


def test_countdown_rows_carry_their_numbers_for_the_reward_and_loaders_refuse_workers():
    from twinkle.dataloader import DataLoader
    from twinkle.preprocessor.llm import CountdownProcessor

    row = Dataset(DatasetMeta("cd", data=[{"target": 7, "nums": [3, 4, 1]}])).map("CountdownProcessor")[0]
    assert row["user_data"] == [{"target": 7, "nums": [3, 4, 1]}] and "[3, 4, 1]" in row["messages"][-1]["content"]
    assert isinstance(CountdownProcessor(), CountdownProcessor)
    with pytest.raises(NotImplementedError, match="num_workers=2"):
        DataLoader(dataset=Dataset(DatasetMeta("cd", data=[{"x": 1}])), batch_size=1, num_workers=2)


def test_enable_thinking_is_a_chat_template_variable():
    template = Template(TEST_MODEL, enable_thinking=False, template_kwargs={"a": 1})
    assert template.template_kwargs == {"a": 1, "enable_thinking": False}
