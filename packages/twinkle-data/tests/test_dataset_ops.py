"""map / filter / encode (cached) / mixing / streaming."""

import json
import logging

import pytest

from twinkle.dataset import DataError, Dataset, DatasetMeta
from twinkle.hub import TEST_MODEL
from twinkle.preprocessor import ArithmeticProcessor, LengthFilter, SelfCognitionProcessor


def sft_dataset(n=20, **template_kw):
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(n)))
    ds.set_template("Template", model_id=TEST_MODEL, max_length=256, **template_kw)
    ds.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    return ds


def test_seed_script_flow():
    ds = sft_dataset(200)
    ds.encode()
    assert len(ds) == 200
    row = ds[0]
    assert row["messages"][1]["content"] == "I am Glimmer, an AI assistant developed by Lantern Labs."
    assert len(row["input_ids"]) == len(row["labels"]) and any(t != -100 for t in row["labels"])
    trained = ds.template.decode([t for t in row["labels"] if t != -100])
    assert trained == "I am Glimmer, an AI assistant developed by Lantern Labs.<|im_end|>"


def test_encode_is_cached_by_lineage(monkeypatch):
    first = sft_dataset()
    first.encode()
    calls = []
    monkeypatch.setattr(type(first.template), "batch_encode", lambda *a, **k: calls.append(1))
    again = sft_dataset()
    again.encode()
    assert calls == [] and again.data.to_list() == first.data.to_list()
    other = sft_dataset()
    other.map(lambda row: row)  # an opaque function: its result cannot be keyed, so no cache
    with pytest.raises(TypeError):  # our stub ran: proof the cache was bypassed
        other.encode()


def test_map_missing_column_names_column_and_preprocessor():
    ds = Dataset(DatasetMeta("twinkle://arithmetic", split="test"))
    with pytest.raises(DataError, match=r"row 0 has no column 'query', which SelfCognitionProcessor reads"):
        ds.map(SelfCognitionProcessor("A", "B"))


def test_filters_and_registry_names():
    ds = Dataset(
        DatasetMeta(
            data=[{"question": "1+1", "answer": "2"}] * 3 + [{"question": "What is 2 + 2, exactly?", "answer": "4"}]
        )
    )
    ds.filter("DedupFilter")
    assert len(ds) == 2
    ds.map("ArithmeticProcessor", with_answer=True).set_template("Template", model_id=TEST_MODEL).encode()
    lengths = sorted(len(r["input_ids"]) for r in ds)
    ds.filter(LengthFilter(max_length=lengths[0]))
    assert [len(r["input_ids"]) for r in ds] == lengths[:1]


def test_encode_delete_drops_long_rows(caplog):
    lengths = sorted(len(r["input_ids"]) for r in sft_dataset(20).encode())
    limit = lengths[10]
    ds = sft_dataset(20, truncation_strategy="delete")
    ds.template.max_length = limit
    with caplog.at_level(logging.WARNING):
        ds.encode()
    assert len(ds) == sum(n <= limit for n in lengths) and all(len(r["input_ids"]) <= limit for r in ds)
    assert f"longer than max_length={limit} were deleted" in caplog.text


def test_encode_raise_names_length_and_limit():
    ds = sft_dataset(5)
    ds.template.max_length = 8
    with pytest.raises(DataError, match=r"row 0: sequence of \d+ tokens is longer than max_length=8"):
        ds.encode()


def mixed(strategy, **kw):
    ds = Dataset(DatasetMeta(data=[{"src": "a", "i": i} for i in range(6)]))
    ds.add_dataset(DatasetMeta("b", data=[{"src": "b", "i": i} for i in range(3)]))
    return [(r["src"], r["i"]) for r in ds.mix_dataset(strategy, **kw)]


def test_mixing_strategies():
    assert mixed("concat") == [("a", i) for i in range(6)] + [("b", i) for i in range(3)]
    assert mixed("interleave") == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
    all_ex = mixed("interleave", stopping_strategy="all_exhausted")
    assert all_ex == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
        ("a", 3),
        ("b", 0),
        ("a", 4),
        ("b", 1),
        ("a", 5),
    ]  # b is oversampled until a is used up
    w1 = mixed("weighted", probabilities=[0.9, 0.1], seed=3, num_samples=8)
    assert w1 == mixed("weighted", probabilities=[0.9, 0.1], seed=3, num_samples=8)
    assert w1 != mixed("weighted", probabilities=[0.9, 0.1], seed=4, num_samples=8)
    assert [i for s, i in w1 if s == "a"] == list(range(sum(s == "a" for s, _ in w1)))  # in order within a part
    with pytest.raises(ValueError, match="one probability per dataset"):
        mixed("weighted", probabilities=[1.0])


def test_add_dataset_map_per_part_then_concat():
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(3)))
    ds.add_dataset(DatasetMeta("twinkle://arithmetic", split="test", data_slice=range(2)))
    ds.map(SelfCognitionProcessor("N", "A"), dataset_meta="twinkle://self-cognition/train")
    ds.map(ArithmeticProcessor(with_answer=True), dataset_meta=ds.keys[1])
    ds.set_template("Template", model_id=TEST_MODEL).encode()
    assert len(ds) == 5 and all("input_ids" in r for r in ds)


def test_streaming_matches_in_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(50))
    )
    eager = Dataset(DatasetMeta(str(path), data_slice=range(5, 45))).map(ArithmeticProcessor())
    lazy = Dataset(DatasetMeta(str(path), data_slice=range(5, 45)), streaming=True, batch_size=7)
    lazy.map(ArithmeticProcessor())
    for d in (eager, lazy):
        d.set_template("Template", model_id=TEST_MODEL).encode(add_generation_prompt=True)
    rows = list(lazy)
    assert len(rows) == 40 and [r["input_ids"] for r in rows] == [r["input_ids"] for r in eager]
    assert rows[0]["ground_truth"] == "6"
    with pytest.raises(TypeError, match="no length"):
        len(lazy)
