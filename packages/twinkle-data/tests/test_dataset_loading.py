"""Loading: bundled ids, every local file format, folders laid out like hub datasets, hub ids offline."""

import json
import socket
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twinkle.dataset import DataError, Dataset, DatasetMeta, OfflineError

ROWS = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]


def test_bundled_ids_load_through_the_folder_path():
    sc = Dataset(DatasetMeta("twinkle://self-cognition"))
    assert len(sc) == 200 and {"query", "response"} <= set(sc.column_names)
    assert "{{NAME}}" in sc[0]["response"]
    train = Dataset(DatasetMeta("twinkle://arithmetic"))
    test = Dataset(DatasetMeta("twinkle://arithmetic", split="test", data_slice=range(5)))
    assert len(train) == 2000 and len(test) == 5
    assert test[0] == {"question": "What is 8 + 36?", "answer": "44"}
    with pytest.raises(DataError, match="no split 'validation'; found: test, train"):
        Dataset(DatasetMeta("twinkle://arithmetic", split="validation"))
    with pytest.raises(DataError, match="unknown bundled dataset"):
        Dataset(DatasetMeta("twinkle://nope"))


def write_all_formats(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "b.json").write_text(json.dumps(ROWS))
    (folder / "c.csv").write_text("question,answer\n" + "".join(f'"{r["question"]}",{r["answer"]}\n' for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), folder / "d.parquet")
    (folder / "e.txt").write_text("first line\n\nsecond line\n")


def test_every_file_format(tmp_path):
    write_all_formats(tmp_path)
    for name in ("a.jsonl", "b.json", "d.parquet"):
        assert Dataset(DatasetMeta(str(tmp_path / name))).data.to_list() == ROWS
    csv = Dataset(DatasetMeta(str(tmp_path / "c.csv")))
    assert csv[1]["question"] == "What is 2 + 2?" and csv[1]["answer"] == 4  # csv columns are typed
    assert Dataset(DatasetMeta(str(tmp_path / "e.txt"))).data.to_list() == [
        {"text": "first line"},
        {"text": "second line"},
    ]


def test_in_memory_rows_columns_and_hf_dataset():
    import datasets

    assert Dataset(DatasetMeta(data=ROWS)).data.to_list() == ROWS
    assert len(Dataset(DatasetMeta(data={"question": ["q"], "answer": ["a"]}))) == 1
    hf = datasets.Dataset.from_list(ROWS)
    assert Dataset(DatasetMeta("mine", data=hf, data_slice=[1]))[0] == ROWS[1]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"question": "x", "answer": }\n')
    with pytest.raises(DataError, match=rf"{path}:3: malformed JSON line"):
        Dataset(DatasetMeta(str(path)))


def test_data_slice_out_of_range():
    with pytest.raises(DataError, match="asks for row 1990 but the dataset has 200 rows"):
        Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(1990, 2001)))


def hub_layout(root):
    """A dataset repo as the hub stores it: data/<split>-*.parquet plus a subset folder."""
    write_all_formats(root / "raw")
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), root / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), root / "data" / "test-00000-of-00001.parquet")
    (root / "hard").mkdir()
    (root / "hard" / "train.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    import shutil

    shutil.rmtree(root / "raw")


def test_hf_id_loads_a_cached_snapshot(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "datasets--org--toy" / "snapshots" / ("0" * 40)
    hub_layout(snapshot)
    (cache / "datasets--org--toy" / "refs").mkdir()
    (cache / "datasets--org--toy" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    assert Dataset(DatasetMeta("hf://org/toy")).data.to_list() == ROWS
    assert Dataset(DatasetMeta("hf://org/toy", split="test")).data.to_list() == ROWS[:1]
    assert Dataset(DatasetMeta("hf://org/toy", subset_name="hard")).data.to_list() == ROWS[1:]


def test_ms_id_loads_its_cache_layout(tmp_path, monkeypatch):
    hub_layout(tmp_path / "datasets" / "org" / "toy")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    assert Dataset(DatasetMeta("ms://org/toy", split="test")).data.to_list() == ROWS[:1]


@pytest.fixture
def silent_server():
    """A loopback port that accepts connections and never answers: the worst case for a hang."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_hf_offline_fails_fast(tmp_path, monkeypatch, silent_server):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", silent_server)
    monkeypatch.setenv("TWINKLE_HUB_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(OfflineError, match="Hugging Face hub .* is unreachable"):
        Dataset(DatasetMeta("hf://org/absent"))
    assert time.monotonic() - start < 5
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="HF_HUB_OFFLINE"):
        Dataset(DatasetMeta("hf://org/absent"))


def test_ms_without_extra_or_network(tmp_path, monkeypatch, silent_server):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    try:
        import modelscope  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"twinkle-data\[modelscope\]"):
            Dataset(DatasetMeta("ms://org/absent"))
        return
    monkeypatch.setenv("MODELSCOPE_DOMAIN", silent_server)
    monkeypatch.setenv("TWINKLE_HUB_TIMEOUT", "0.5")
    with pytest.raises(OfflineError, match="ModelScope"):
        Dataset(DatasetMeta("ms://org/absent"))


def test_unknown_path_is_a_clear_error():
    with pytest.raises(DataError, match="neither a local file or folder nor a dataset id"):
        Dataset(DatasetMeta("./no/such/place"))


def test_a_jsonl_read_in_chunks_equals_one_table_of_all_its_rows(tmp_path):
    """Keys and struct fields that only a later chunk has, and ints that turn into floats, come out as
    if every row had been converted at once."""
    from twinkle.dataset.readers import iter_rows, read_file, rows_to_columns

    path = tmp_path / "mixed.jsonl"
    with path.open("w") as f:
        for i in range(1000):
            row = {"id": i, "messages": [{"role": "user", "content": f"q{i}"}]}
            if i == 650:
                row["messages"][0]["loss"] = False
                row["score"] = 2.5
            if i == 10:
                row["score"] = 1
            f.write(json.dumps(row) + "\n")
    chunked = read_file(path, chunk_rows=300)
    whole = pa.Table.from_pydict(rows_to_columns(list(iter_rows(path))))
    assert chunked.schema == whole.schema and chunked.schema.field("score").type == pa.float64()
    assert chunked.to_pylist() == whole.to_pylist()
    assert chunked.to_pylist()[650]["messages"][0]["loss"] is False
