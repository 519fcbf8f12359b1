"""Encoding at scale (twinkle.dataset.encode_to_arrow): the Arrow file equals the in-memory encoding row
for row, in order, with a worker pool; memory stays bounded (rows held at once do not grow with the
data, and a fresh process's peak RSS barely moves when the file grows 10x)."""

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twinkle.dataset import DataError, Dataset, DatasetMeta, encode_to_arrow
from twinkle.dataset.loading import rows_to_dataset
from twinkle.hub import TEST_MODEL
from twinkle.template import Template

WORDS = "the a river stone light seven quiet number lantern glimmer over under bright".split()


def chat_rows(n: int, seed: int = 0, words: int = 12):
    rng = random.Random(seed)
    for i in range(n):
        messages = [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, words)))},
            {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, words)))},
        ]
        if i % 3 == 0:  # some multi-turn rows
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "done"}]
        yield {"id": i, "messages": messages}


@pytest.fixture(scope="module")
def short_template():
    # rows over 40 tokens are deleted: dropped rows must not shift the others
    return Template(model_id=TEST_MODEL, max_length=40, truncation_strategy="delete")


def in_memory(rows, template):
    return rows_to_dataset([e for e in template.batch_encode(rows) if e is not None]).to_list()


def test_pool_output_equals_in_memory_encoding_row_for_row(tmp_path, short_template):
    rows = list(chat_rows(500))
    expected = in_memory(rows, short_template)
    assert 0 < len(expected) < len(rows)  # some rows were really dropped
    encoded, report = encode_to_arrow(iter(rows), short_template, tmp_path / "out.arrow", num_proc=2, chunk_rows=37)
    assert encoded.to_list() == expected
    assert (report.rows_read, report.rows_written, report.dropped) == (500, len(expected), 500 - len(expected))
    assert report.max_rows_held <= 2 * 2 * 37


def test_dataset_encode_through_the_pool_equals_serial(short_template):
    rows = list(chat_rows(300, seed=1))
    serial = Dataset(DatasetMeta(data=rows)).set_template(short_template).encode(cache=False)
    pooled = Dataset(DatasetMeta(data=rows), batch_size=50).set_template(short_template).encode(num_proc=2)
    assert pooled.data.to_list() == serial.data.to_list() == in_memory(rows, short_template)
    assert pooled.data.cache_files  # memory-mapped from the cache file, not held in memory


def test_rows_held_do_not_grow_with_the_data(tmp_path, tiny_template):
    held = []
    for n in (1_000, 10_000):
        _, report = encode_to_arrow(chat_rows(n), tiny_template, tmp_path / f"{n}.arrow", chunk_rows=100)
        assert report.rows_written == n
        held.append(report.max_rows_held)
    assert held == [100, 100]


def test_a_bad_row_in_a_worker_names_its_row(tmp_path, tiny_template):
    rows = list(chat_rows(120))
    rows[77] = {"id": 77, "messages": [{"content": "no role"}]}
    with pytest.raises(DataError, match="row 77: every message needs a 'role'"):
        encode_to_arrow(rows, tiny_template, tmp_path / "bad.arrow", num_proc=2, chunk_rows=25)


PEAK_RSS = textwrap.dedent("""
    import json, resource, sys
    from twinkle.dataset import encode_to_arrow
    from twinkle.hub import TEST_MODEL
    from twinkle.template import Template
    sys.path.insert(0, sys.argv[3])
    from test_dataset_encode_scale import chat_rows
    template = Template(model_id=TEST_MODEL)
    _, report = encode_to_arrow(chat_rows(int(sys.argv[1]), words=60), template, sys.argv[2], chunk_rows=200)
    print(json.dumps({"rows": report.rows_written, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


def test_peak_memory_stays_flat_when_the_rows_grow_10x(tmp_path):
    """Holding 10k encoded rows (~190 tokens each) as Python lists adds ~290 MB to the peak (measured);
    streamed, the peak of a fresh process must grow by less than 40 MB."""
    peaks = {}
    for n in (1_000, 10_000):
        out = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(n), str(tmp_path / f"{n}.arrow"), str(Path(__file__).parent)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["rows"] == n
        peaks[n] = result["peak_kb"]
    assert peaks[10_000] - peaks[1_000] < 40 * 1024, peaks


def test_columns_that_change_between_chunks_come_out_as_one_conversion_would(tmp_path, tiny_template):
    """A column None in the first chunk and numbers later, an int column that turns float, a message
    field and a key only later rows have: nothing is dropped or refused, the types are the widest."""
    rows = list(chat_rows(90))
    for row in rows:
        row["score"] = None
    rows[45]["score"] = 3
    rows[70]["score"] = 0.5
    rows[80]["messages"][1]["loss"] = False
    rows[85]["source"] = "web"
    expected = in_memory(rows, tiny_template)
    encoded, _ = encode_to_arrow(rows, tiny_template, tmp_path / "drift.arrow", chunk_rows=20)
    assert encoded.to_list() == expected
    assert encoded[80]["messages"][1]["loss"] is False and encoded[85]["source"] == "web"
    assert encoded.features["score"].dtype == "float64"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drift.arrow"]  # segments cleaned up
