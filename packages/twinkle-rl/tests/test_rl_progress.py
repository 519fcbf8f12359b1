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
