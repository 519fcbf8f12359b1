"""DataLoader: exact resume, data-rank slices, seeded shuffle, bad samples skipped with reasons."""

import functools
import logging
import operator

import pytest

from twinkle.dataloader import DataLoader
from twinkle.dataset import DataError, Dataset, DatasetMeta
from twinkle.hub import TEST_MODEL
from twinkle.mesh import DeviceMesh
from twinkle.preprocessor import ArithmeticProcessor


class Rank:
    def __init__(self, rank, world):
        self.data_rank, self.data_world_size = rank, world


@pytest.fixture(scope="module")
def encoded():
    ds = Dataset(DatasetMeta("twinkle://arithmetic", split="test", data_slice=range(50)))
    ds.map(ArithmeticProcessor(with_answer=True)).set_template("Template", model_id=TEST_MODEL).encode()
    return ds


def ids(batch):
    return [r["question"] if "question" in r else r["messages"][-2]["content"] for r in batch]


def test_resume_equals_uninterrupted(encoded):
    full = [ids(b) for b in DataLoader(encoded, batch_size=8, seed=7)]
    assert len(full) == 7 and len(full[-1]) == 2  # 50 rows: six full batches and a short one
    first = DataLoader(encoded, batch_size=8, seed=7)
    seen = []
    for k, batch in enumerate(first):
        seen.append(ids(batch))
        if k == 2:
            break
    state = first.state_dict()
    resumed = DataLoader(encoded, batch_size=8, seed=7)
    resumed.load_state_dict(state)
    assert seen + [ids(b) for b in resumed] == full
    # the next epoch is a different permutation, the same on every run
    assert [ids(b) for b in resumed] == [ids(b) for b in (lambda d: (list(d), d)[1])(DataLoader(encoded, 8, seed=7))]
    assert [ids(b) for b in resumed] != full
    with pytest.raises(ValueError, match="saved seed=7 differs"):
        DataLoader(encoded, batch_size=8, seed=8).load_state_dict(state)


def test_two_data_ranks_see_exactly_the_global_batch(encoded, monkeypatch):
    glob = [ids(b) for b in DataLoader(encoded, batch_size=8, seed=1, min_batch_size=8)]
    for make in (lambda r: Rank(r, 2), lambda r: DeviceMesh.from_sizes(dp_size=2)):
        per_rank = []
        for r in (0, 1):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv("WORLD_SIZE", "2")
            per_rank.append(
                [ids(b) for b in DataLoader(encoded, batch_size=8, seed=1, min_batch_size=8, device_mesh=make(r))]
            )
        assert len(per_rank[0]) == len(per_rank[1]) == len(glob) == 6
        for g, a, b in zip(glob, *per_rank):
            assert len(a) == len(b) == 4 and a + b == g and not set(a) & set(b)
    with pytest.raises(ValueError, match="multiple of the data world size 2"):
        DataLoader(encoded, batch_size=5, device_mesh=Rank(0, 2))


def test_shuffle_is_seeded(encoded):
    a = [ids(b) for b in DataLoader(encoded, batch_size=10, seed=3)]
    assert a == [ids(b) for b in DataLoader(encoded, batch_size=10, seed=3)]
    assert a != [ids(b) for b in DataLoader(encoded, batch_size=10, seed=4)]
    plain = [ids(b) for b in DataLoader(encoded, batch_size=10, shuffle=False)]
    assert plain[0] == [encoded[i]["messages"][-2]["content"] for i in range(10)]
    assert sorted(functools.reduce(operator.iadd, a, [])) == sorted(functools.reduce(operator.iadd, plain, []))


def test_bad_samples_skipped_with_reason_bounded(caplog):
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "n": i} for i in range(10)]
    rows[3]["labels"] = [-100, -100, -100]
    rows[6]["input_ids"], rows[6]["labels"] = [], []
    loader = DataLoader(rows, batch_size=4, shuffle=False)
    with caplog.at_level(logging.WARNING):
        batches = [[r["n"] for r in b] for b in loader]
    assert batches == [[0, 1, 2, 4], [5, 7, 8, 9]]
    assert "skipping sample 3 (epoch 0): no token carries loss" in caplog.text
    assert "skipping sample 6 (epoch 0): empty input_ids" in caplog.text
    bad = [{"input_ids": [], "labels": []}] * 10
    with pytest.raises(DataError, match=r"4 bad samples in a row \(max_retries=3\)"):
        list(DataLoader(bad, batch_size=2, max_retries=3))


def test_min_batch_size_and_len(encoded):
    assert len(DataLoader(encoded, batch_size=8)) == 7
    assert len(DataLoader(encoded, batch_size=8, min_batch_size=8)) == 6
    assert [len(b) for b in DataLoader(encoded, batch_size=8, min_batch_size=8)] == [8] * 6


def test_streaming_resume(tmp_path):
    import json

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(30)))

    def make():
        return DataLoader(
            Dataset(DatasetMeta(str(path)), streaming=True),
            batch_size=4,
            seed=5,
            shuffle_buffer=8,
        )

    full = [[r["question"] for r in b] for b in make()]
    assert sorted(functools.reduce(operator.iadd, full, [])) == sorted(f"q{i}" for i in range(30)) and full[0] != [
        "q0",
        "q1",
        "q2",
        "q3",
    ]
    first = make()
    it = iter(first)
    head = [[r["question"] for r in next(it)] for _ in range(3)]
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + [[r["question"] for r in b] for b in second] == full


def test_default_mesh_follows_the_runtime(monkeypatch):
    import twinkle.mesh.runtime as runtime
    from twinkle.dataloader.mesh import resolve_mesh

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    mesh = resolve_mesh(None)  # torchrun without initialize: one data dim over the world
    assert (mesh.data_rank, mesh.data_world_size) == (1, 2)
    monkeypatch.setattr(runtime, "_RUNTIME", type("R", (), {"mode": "ray"})())
    assert resolve_mesh(None).data_world_size == 1  # the Ray driver feeds whole global batches
    with pytest.raises(TypeError, match="has no 'data_rank'"):
        resolve_mesh(object())
