"""The RL warm start (a full-parameter SFT loop) draws a progress bar on stderr when it is a terminal,
and none when it is not (tqdm's disable=None)."""

import io
import sys

import pytest

from twinkle.hub import TEST_MODEL
from twinkle.rl.demo import warm_start


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, drawn", [(Terminal, True), (io.StringIO, False)])
def test_warm_start_bar_only_on_a_terminal(monkeypatch, tmp_path, stream, drawn):
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    folder = warm_start(TEST_MODEL, steps=3, batch_size=4, cache_dir=tmp_path, log=None)
    assert (tmp_path / folder).joinpath("config.json").is_file()
    if drawn:
        assert "warm-start SFT" in err.getvalue() and "3/3" in err.getvalue() and "loss=" in err.getvalue()
    else:  # (transformers' own "Loading weights" bars print regardless: its choice, not ours)
        assert "warm-start" not in err.getvalue() and "loss=" not in err.getvalue()


def test_a_format_only_warm_start_trains_on_shuffled_answers(monkeypatch, tmp_path):
    """format_only keeps every prompt and the answers' counts, but pairs them at random, and is cached apart."""
    from collections import Counter

    import twinkle.rl.demo as demo

    seen = {}
    real = demo._sft_rows

    def spy(template, rows, task):
        seen[task] = rows
        return real(template, rows[:8], task)

    monkeypatch.setattr(demo, "_sft_rows", spy)
    plain = warm_start(TEST_MODEL, steps=1, batch_size=2, cache_dir=tmp_path, log=None, task="larger")
    truth = seen.pop("larger")
    shuffled = warm_start(
        TEST_MODEL, steps=1, batch_size=2, cache_dir=tmp_path, log=None, task="larger", format_only=True
    )
    rows = seen.pop("larger")
    assert plain != shuffled and "format" in shuffled
    assert [r["question"] for r in rows] == [r["question"] for r in truth]
    assert Counter(r["answer"] for r in rows) == Counter(r["answer"] for r in truth)
    wrong = sum(r["answer"] != t["answer"] for r, t in zip(rows, truth))
    assert 0.4 < wrong / len(rows) < 0.6  # two answers: a random pairing is wrong about half the time
