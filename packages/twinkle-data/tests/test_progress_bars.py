"""Progress bars on long data jobs (dataset encoding, embedded model builds): drawn on stderr when it
is a terminal, nothing at all when it is not (tqdm's disable=None); hub download bars left on."""

import io
import sys

import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import TEST_MODEL
from twinkle.hub.embedded import write_folder
from twinkle.preprocessor import SelfCognitionProcessor


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def encode(n=30, cache=False):
    ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(n)))
    ds.set_template("Template", model_id=TEST_MODEL, max_length=256)
    ds.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    return ds.encode(cache=cache)


@pytest.mark.parametrize("stream, drawn", [(Terminal, True), (io.StringIO, False)])
def test_encoding_draws_a_bar_only_on_a_terminal(monkeypatch, stream, drawn):
    encode(2)  # build the tokenizer first: only the encode bar is under test
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    assert len(encode(30)) == 30
    if drawn:
        assert "encode" in err.getvalue() and "30/30" in err.getvalue() and "100%" in err.getvalue()
    else:
        assert err.getvalue() == ""


@pytest.mark.parametrize("stream, drawn", [(Terminal, True), (io.StringIO, False)])
def test_embedded_build_draws_a_bar_only_on_a_terminal(monkeypatch, tmp_path, stream, drawn):
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    write_folder("qwen3-tiny", tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    if drawn:
        assert "build twinkle://qwen3-tiny" in err.getvalue() and "3/3" in err.getvalue()
    else:
        assert err.getvalue() == ""


def test_hub_download_bars_stay_on(tmp_path):
    from datasets.utils import are_progress_bars_disabled as datasets_bars_off
    from huggingface_hub.utils import are_progress_bars_disabled as hub_bars_off

    encode(5, cache=True)  # the encode cache writes quietly and must hand the bars back
    assert (tmp_path / "twinkle-cache" / "encoded").is_dir()  # (conftest: a private cache per test)
    assert not hub_bars_off() and not datasets_bars_off()
